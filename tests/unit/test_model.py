import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from forgeline.configs.schema import ModelConfig
from forgeline.model.inference import PackedLinear, generate_batch, pack_linears
from forgeline.model.training.metrics import straggler
from forgeline.model.transformer import KVCache, Transformer

ARGS = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def build(seed: int = 0, args: ModelConfig = ARGS) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(seed)
    return model


def test_forward_shape() -> None:
    logits = build()(torch.randint(0, 97, (3, 16)))
    assert logits.shape == (3, 16, 97)
    assert torch.isfinite(logits).all()


def test_causal_future_tokens_do_not_change_the_past() -> None:
    model = build()
    tokens = torch.randint(0, 97, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 97
    torch.testing.assert_close(model(tokens)[0, :10], model(changed)[0, :10])
    assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:])


def test_meta_build_then_init_is_deterministic_per_seed() -> None:
    a, b, c = build(0).state_dict(), build(0).state_dict(), build(1).state_dict()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_num_params_matches_the_module() -> None:
    assert ARGS.num_params() == sum(p.numel() for p in build().parameters())


def test_grouped_query_attention_has_fewer_kv_weights() -> None:
    attention = build().layers["0"].attention
    assert attention.wq.weight.shape == (32, 32)
    assert attention.wk.weight.shape == (16, 32)  # 2 kv heads of dim 8


def generate(model: Transformer, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """One prompt's continuation."""
    return generate_batch(model, [prompt], max_new_tokens, **kwargs)[0]


def test_greedy_generation_is_deterministic_and_stops() -> None:
    model = build().eval()
    first = generate(model, [1, 2, 3], max_new_tokens=8)
    assert first == generate(model, [1, 2, 3], max_new_tokens=8)
    assert len(first) == 8
    assert generate(model, [1, 2, 3], max_new_tokens=8, stop=lambda row, new: len(new) == 3) == first[:3]
    assert generate(model, [1, 2, 3], max_new_tokens=8, stop_token=first[0]) == []


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="packing needs oneDNN")
@torch.no_grad()
def test_packed_linears_compute_what_the_plain_ones_do() -> None:
    model = build().eval()
    tokens = torch.randint(0, 97, (3, 16))
    logits, continuation, state = model(tokens), generate(model, [1, 2, 3], 8), model.state_dict()
    assert pack_linears(model) is model
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == 2 * 7 + 1
    torch.testing.assert_close(model(tokens), logits, rtol=1e-5, atol=1e-5)
    assert generate(model, [1, 2, 3], 8) == continuation
    assert model.state_dict().keys() == state.keys()  # exports and checkpoints see the same model


def test_training_flops_count_matmuls_and_attention() -> None:
    args = ModelConfig(vocab_size=100, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32)
    matmul_weights = args.num_params() - 100 * 16 - (2 * 2 + 1) * 16  # no embedding table, no norms
    assert args.flops_per_token(seq_len=64) == 6 * matmul_weights + 12 * 2 * 16 * 64
    # Frozen weights (LoRA) take no weight gradient: the forward and the backward to the inputs.
    assert args.flops_per_token(seq_len=64, frozen=True) == 4 * matmul_weights + 12 * 2 * 16 * 64


def test_a_rank_well_above_the_median_is_named_a_straggler() -> None:
    assert straggler([0.10, 0.11, 0.10, 0.30]) == 3
    assert straggler([0.10, 0.11, 0.10, 0.115]) is None
    assert straggler([0.2]) is None


def greedy_without_cache(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def test_cached_decoding_matches_full_forward_passes() -> None:
    model = build().eval()
    tokens = torch.randint(0, 97, (1, 12))
    full = model(tokens)
    cache = KVCache(ARGS, 1, 12, torch.device("cpu"), torch.float32)
    prefix = model(tokens[:, :5], cache)
    steps = [model(tokens[:, i:i + 1], cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, atol=1e-5, rtol=1e-5)


def test_batched_generation_of_uneven_prompts_matches_one_at_a_time() -> None:
    model = build().eval()
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [42]]
    batched = generate_batch(model, prompts, max_new_tokens=6)
    for prompt, new in zip(prompts, batched, strict=True):
        assert new == greedy_without_cache(model, prompt, 6)
        assert new == generate(model, prompt, max_new_tokens=6)


def test_rows_that_stop_leave_the_batch_and_the_others_go_on_unchanged() -> None:
    model = build().eval()
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [42], [5, 6]]
    full = generate_batch(model, prompts, max_new_tokens=6)
    stops_after = {0: 1, 2: 3}  # rows 0 and 2 finish early, at different steps
    cut = generate_batch(model, prompts, max_new_tokens=6,
                         stop=lambda row, new: len(new) == stops_after.get(row, -1))
    assert cut == [full[0][:1], full[1], full[2][:3], full[3]]


def decode_steps(model: Transformer) -> list[int]:
    """The rows of each one-token forward the model computes from now on (its decoding steps)."""
    rows: list[int] = []

    def record(_: nn.Module, args: tuple[torch.Tensor]) -> None:
        if args[0].size(1) == 1:
            rows.append(args[0].size(0))
    model.tok_embeddings.register_forward_pre_hook(record)
    return rows


def test_a_row_that_ends_gives_its_place_to_the_next_prompt() -> None:
    model = build().eval()
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [42], [5, 6, 4]]
    full = [greedy_without_cache(model, prompt, 6) for prompt in prompts]
    stops_after = {0: 1, 1: 5, 2: 2, 3: 4}
    steps = decode_steps(model)
    cut = generate_batch(model, prompts, max_new_tokens=6, batch_size=2,
                         stop=lambda row, new: len(new) == stops_after[row])
    assert cut == [full[row][:stops_after[row]] for row in range(4)]
    # Two rows a step while a prompt waits: prompt 2 enters after step 1, prompt 3 after step 3;
    # batches of two held up by their longest reply would take 5 + 4 = 9 steps.
    assert steps == [2, 2, 2, 2, 2, 1, 1]


def test_replies_longer_than_the_first_columns_of_the_cache_are_unchanged() -> None:
    model = build().eval()
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    cache = KVCache(ARGS, 2, 28, torch.device("cpu"), torch.float32, reserve=4)  # grows 4 -> 8 -> 16 -> 28
    logits = [model(torch.tensor([p[:3] for p in prompts]), cache)[:, -1]]
    for step in range(20):
        logits.append(model(torch.tensor([[step], [step + 1]]), cache)[:, -1])
    assert cache.keys["0"].size(2) == 28
    tokens = torch.tensor([[*p[:3], *range(k, k + 20)] for p, k in zip(prompts, (0, 1), strict=True)])
    torch.testing.assert_close(torch.stack(logits, 1), model(tokens)[:, 2:], atol=1e-5, rtol=1e-5)


def test_sampling_is_reproducible_with_a_generator() -> None:
    model = build().eval()
    draw = lambda: generate(model, [1, 2], 8, temperature=1.0, generator=torch.Generator().manual_seed(3))  # noqa: E731
    assert draw() == draw()


def test_a_tied_embedding_gets_both_gradients_without_a_matrix_of_its_own() -> None:
    """The embedding rows' gradient goes straight into the shared matrix's gradient: the same
    gradient as the untied model's two summed, and no (V, C) embedding backward."""
    tied = build(args=ARGS.model_copy(update={"tie_embeddings": True}))
    untied = build(args=ARGS.model_copy(update={"tie_embeddings": False}))
    untied.load_state_dict(tied.state_dict(), strict=False)
    untied.output.weight.data.copy_(tied.output.weight)
    tokens = torch.randint(0, 97, (3, 16))
    with OpLog() as ops:
        tied(tokens).square().mean().backward()
    untied(tokens).square().mean().backward()
    assert torch.ops.aten.embedding_dense_backward.default not in ops.called
    expected = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(tied.tok_embeddings.weight.grad, expected, rtol=1e-5, atol=1e-7)
    for (name, param), reference in zip(tied.named_parameters(), untied.parameters(), strict=False):
        if name != "tok_embeddings.weight":
            torch.testing.assert_close(param.grad, reference.grad, rtol=1e-5, atol=1e-7)


class OpLog(TorchDispatchMode):
    """The aten ops that run inside the block."""

    def __enter__(self) -> "OpLog":
        self.called: set = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.called.add(func)
        return func(*args, **(kwargs or {}))
