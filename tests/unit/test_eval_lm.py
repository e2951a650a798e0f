import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from forgeline.configs.schema import DimensionConfig, ModelConfig
from forgeline.eval.dimensions import task_score
from forgeline.eval.lm import ForgelineLM, Sequence, pack_rows
from forgeline.eval.scores import TaskItems
from forgeline.model.checkpoint.manager import MANIFEST_NAME
from forgeline.model.hf import export_hf
from forgeline.tasks.evaluate import EvaluatedItems, Scoring, scores_cache_file, scoring_record
from tests.conftest import random_lm


def one_at_a_time(lm: ForgelineLM, method, requests: list[Instance]) -> list:
    """`method`'s answers with a batch size of 1 (the fixture's batch size restored after)."""
    batch_size, lm.batch_size = lm.batch_size, 1
    try:
        return method(requests)
    finally:
        lm.batch_size = batch_size


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bundle")


@pytest.fixture(scope="module")
def lm(data_root: Path, bundle: Path) -> ForgelineLM:
    return random_lm(data_root / "data" / "tokenizer", bundle, max_seq_len=48, batch_size=4)


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@torch.no_grad()
def direct_logprob(lm: ForgelineLM, tokens: list[int], n_target: int) -> float:
    inputs = torch.tensor([tokens[:-1]])
    logprobs = F.log_softmax(lm.model(inputs)[0].float(), dim=-1)
    positions = range(len(tokens) - 1 - n_target, len(tokens) - 1)
    return sum(float(logprobs[p, tokens[p + 1]]) for p in positions)


def test_loglikelihood_matches_a_direct_forward_pass(lm: ForgelineLM) -> None:
    context, continuation = "KING HENRY: Once more unto the breach,", " dear friends"
    [(score, _)] = lm.loglikelihood([request("loglikelihood", context, continuation)])
    whole = lm.tok_encode(context + continuation)
    n_cont = len(whole) - len(lm.tok_encode(context))
    assert score == pytest.approx(direct_logprob(lm, whole, n_cont), abs=1e-4)


def test_scores_do_not_depend_on_batching(lm: ForgelineLM) -> None:
    requests = [request("loglikelihood", f"Question {i}: who is {'very ' * i}brave?", " Hal")
                for i in range(9)]
    batched = lm.loglikelihood(requests)
    single = one_at_a_time(lm, lm.loglikelihood, requests)
    for (a, greedy_a), (b, greedy_b) in zip(batched, single, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b


ROMEO = "O Romeo, Romeo! wherefore art thou Romeo? " * 6  # longer than max_length 48


def rolling_by_hand(lm: ForgelineLM, text: str) -> float:
    """A document's log-likelihood in windows of disjoint targets, max_length tokens each: the
    first predicted from the EOS prefix."""
    tokens = lm.tok_encode(text)
    expected = 0.0
    stream = [lm.eot_token_id] + tokens
    for start in range(0, len(tokens), lm.max_length):
        end = min(start + lm.max_length, len(tokens))
        window = stream[max(0, end - lm.max_length): end + 1]
        expected += direct_logprob(lm, window, end - start)
    return expected


def test_rolling_loglikelihood_covers_every_token_once(lm: ForgelineLM) -> None:
    assert len(lm.tok_encode(ROMEO)) > lm.max_length
    [total] = lm.loglikelihood_rolling([request("loglikelihood_rolling", ROMEO)])
    assert total == pytest.approx(rolling_by_hand(lm, ROMEO), abs=1e-3)


def test_documents_are_scored_in_the_window_given_by_default_the_models_context(
        lm: ForgelineLM, bundle: Path, data_root: Path) -> None:
    """The window changes a document's score: two models compared item by item are scored in one
    (tasks/evaluate.py, Scoring); none longer than the model's context is accepted."""
    tokenizer = str(data_root / "data" / "tokenizer")
    assert lm.max_length == lm.model.shape.max_seq_len == 48
    # A string, as lm-eval's model_args give it.
    narrow = ForgelineLM(bundle=str(bundle), tokenizer=tokenizer, batch_size=4, max_length="20")
    assert narrow.max_length == 20
    [total] = narrow.loglikelihood_rolling([request("loglikelihood_rolling", ROMEO)])
    assert total == pytest.approx(rolling_by_hand(narrow, ROMEO), abs=1e-3)
    [wide] = lm.loglikelihood_rolling([request("loglikelihood_rolling", ROMEO)])
    assert abs(total - wide) > 1e-2
    with pytest.raises(ValueError, match="max_length=49 does not fit the model's context of 48 tokens"):
        ForgelineLM(bundle=str(bundle), tokenizer=tokenizer, max_length=49)


def test_a_run_and_its_base_are_scored_with_the_runs_tokenizer_in_windows_of_its_context(
        data_root: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "step-00000002"
    checkpoint.mkdir()
    shape = ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                        max_seq_len=96)
    (checkpoint / MANIFEST_NAME).write_text(json.dumps({"model_args": shape.model_dump(mode="json")}))
    scoring = Scoring.of_run(checkpoint, data_root / "data", "bf16")
    assert scoring.model_args() == {"tokenizer": str(data_root / "data" / "tokenizer"), "max_length": 96,
                                    "precision": "bf16"}


def test_cached_scores_are_keyed_by_the_tokenizer_the_window_and_the_precision(
        data_root: Path, tmp_path: Path) -> None:
    """A base's scores cached under another window, another end-of-text token or another
    precision are not read back; its weights' location is not part of the key (their sha256 is,
    in `model`)."""
    plan = {"language_modeling": ([task_score("forgeline_heldout")],
                                  DimensionConfig(tasks=["forgeline_heldout"], limit=3, num_fewshot=0))}
    tokenizer = data_root / "data" / "tokenizer"
    chat = shutil.copytree(tokenizer, tmp_path / "chat")
    settings = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps(settings | {"eos_token": "<|im_end|>"}))

    def cache_file(weights: str, tokenizer: Path, max_length: int | None, precision: str = "fp32") -> Path:
        model_args = {"hf": weights, "tokenizer": str(tokenizer), "precision": precision}
        if max_length is not None:
            model_args["max_length"] = max_length
        return scores_cache_file({"base": "0" * 64}, model_args, "suite", plan, 8)

    key = cache_file("base", tokenizer, 512)
    assert cache_file("moved/base", tokenizer, 512) == key
    assert len({key, cache_file("base", tokenizer, 256), cache_file("base", tokenizer, None),
                cache_file("base", chat, 512), cache_file("base", tokenizer, 512, "bf16")}) == 5
    assert scoring_record({"tokenizer": str(tokenizer), "precision": "bf16"})["precision"] == "bf16"


def test_items_scored_in_another_window_do_not_pair() -> None:
    plan = {"language_modeling": {"tasks": ["forgeline_heldout"], "limit": 2, "num_fewshot": 0}}
    items = {"forgeline_heldout": TaskItems(ids=["a", "b"], values=[[-9.0, 4], [-7.0, 3]])}
    run = EvaluatedItems("suite", plan, items, max_length=512)
    assert run.unpaired(replace(run, max_length=512)) == []
    [why] = run.unpaired(replace(run, max_length=256))
    assert why == "scored in windows of 512 tokens, not windows of 256 tokens"
    [why] = run.unpaired(replace(run, max_length=None))  # a record from before the window was kept
    assert why == "scored in windows of 512 tokens, not unrecorded windows"


def test_items_scored_in_another_precision_do_not_pair(tmp_path: Path) -> None:
    plan = {"language_modeling": {"tasks": ["forgeline_heldout"], "limit": 2, "num_fewshot": 0}}
    items = {"forgeline_heldout": TaskItems(ids=["a", "b"], values=[[-9.0, 4], [-7.0, 3]])}
    run = EvaluatedItems("suite", plan, items, max_length=512, precision="bf16")
    assert run.unpaired(replace(run, precision="bf16")) == []
    [why] = run.unpaired(replace(run, precision="fp32"))
    assert why == "scored in bf16, not fp32"
    # A record from before the precision was kept was scored in fp32, the only one there was.
    before = tmp_path / "items.json"
    suite = {"fingerprint": "suite", "plan": plan, "scoring": {"max_length": 512}}
    before.write_text(json.dumps({"suite": suite, "model": {"forgeline_heldout": {
        "ids": ["a", "b"], "values": [[-9.0, 4], [-7.0, 3]]}}}))
    assert EvaluatedItems.read(before) == replace(run, precision="fp32")


def test_generate_until_cuts_at_the_stop_sequence(lm: ForgelineLM) -> None:
    def run(until: list[str]) -> str:
        gen_kwargs = {"until": until, "max_gen_toks": 16}
        [text] = lm.generate_until([request("generate_until", "ROMEO:", gen_kwargs)])
        return text

    free = run(["\u2603"])  # a stop sequence that never appears: 16 greedy tokens
    assert len(free) >= 4
    stop = free[len(free) // 2:][:2]
    assert run([stop]) == free.split(stop)[0]


def test_exactly_one_model_source_is_required(data_root: Path) -> None:
    with pytest.raises(ValueError, match="exactly one of checkpoint=..., bundle=... or hf=..."):
        ForgelineLM(tokenizer=str(data_root / "data" / "tokenizer"))


def test_a_shared_context_is_computed_once(lm: ForgelineLM) -> None:
    tokens: list[int] = []  # tokens embedded per forward

    def count(module, args, out) -> None:
        tokens.append(args[0].numel())

    hook = lm.model.tok_embeddings.register_forward_hook(count)
    try:
        # Four one-token answers to one question: the context is the only input.
        context = lm.tok_encode("Question: who is the Prince of Denmark? Answer:")
        scores = lm._loglikelihood_tokens([(None, context, [answer]) for answer in (40, 41, 42, 43)])
    finally:
        hook.remove()
    assert sum(tokens) == len(context) and len(set(scores)) == 4


def test_shared_context_scores_equal_whole_input_scores(lm: ForgelineLM) -> None:
    context = lm.tok_encode("HAMLET: To be, or not to be, that is the question:")
    choices = [" Whether 'tis nobler", " in the mind to suffer", " the slings", " and arrows of fortune"]
    requests = [(None, context, lm.tok_encode(c)) for c in choices]
    requests.append((None, lm.tok_encode("A different question"), lm.tok_encode(" alone")))
    for (score, _greedy), (_, ctx, cont) in zip(lm._loglikelihood_tokens(requests), requests, strict=True):
        assert score == pytest.approx(direct_logprob(lm, ctx + cont, len(cont)), abs=1e-4)


def test_short_requests_fill_the_room_a_long_one_leaves(lm: ForgelineLM) -> None:
    tokens: list[int] = []  # positions computed per forward

    def count(module, args, out) -> None:
        tokens.append(args[0].numel())

    long = lm.tok_encode("KING LEAR: Blow, winds, and crack your cheeks! rage! blow! You cataracts")
    short = [lm.tok_encode(f"Fool {i}: nuncle") for i in range(9)]
    short = short[: (len(long) - 1) // (len(short[0]) - 1)]  # as many as fit in a row as wide as the long one
    requests = [(None, long[:-1], long[-1:])] + [(None, s[:-1], s[-1:]) for s in short]
    assert len(short) > 1
    hook = lm.model.tok_embeddings.register_forward_hook(count)
    try:
        scores = lm._loglikelihood_tokens(requests)
    finally:
        hook.remove()
    assert sum(tokens) == 2 * (len(long) - 1)  # two rows: the long request, then all the short ones
    for (score, _greedy), (_, ctx, cont) in zip(scores, requests, strict=True):
        assert score == pytest.approx(direct_logprob(lm, ctx + cont, len(cont)), abs=1e-4)


def test_pack_rows_fills_rows_first_fit_and_keeps_every_sequence() -> None:
    sequences = []
    for length in (9, 2, 7, 3, 5, 1, 4):
        sequences.append(Sequence())
        sequences[-1].extend(list(range(length)), 0, 0)
    batches = list(pack_rows(sequences, rows=2))
    lengths = [[[len(s) for s in row] for row in batch] for batch in batches]
    assert lengths == [[[9], [7, 2]], [[5], [4, 1]], [[3]]]


def test_batched_generation_matches_one_request_at_a_time(lm: ForgelineLM) -> None:
    settings = {"until": ["\n\n"], "max_gen_toks": 10}
    requests = [request("generate_until", prompt, settings) for prompt in
                ("ROMEO:", "JULIET: O Romeo, Romeo,", "To be", "Enter HAMLET and HORATIO")]
    batched = lm.generate_until(requests)
    single = one_at_a_time(lm, lm.generate_until, requests)
    assert batched == single


def test_a_hugging_face_export_loads_with_the_same_scores(lm: ForgelineLM, data_root: Path,
                                                          tmp_path: Path) -> None:
    export_hf(lm.model, data_root / "data" / "tokenizer", tmp_path / "hf")
    from_hf = ForgelineLM(hf=str(tmp_path / "hf"), tokenizer=str(tmp_path / "hf"), batch_size=4)
    reqs = [request("loglikelihood", "Question: who?", " Hamlet"), request("loglikelihood", "Be", " not")]
    for (a, _), (b, _) in zip(lm.loglikelihood(reqs), from_hf.loglikelihood(reqs), strict=True):
        assert a == pytest.approx(b, abs=1e-4)
