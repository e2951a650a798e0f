"""IFEval's prompts apart by whether preference tuning trained their instruction types.

Preference pairs (the `pairs` section) teach the constraints of some of the IFEval registry's
instruction types (`pairs.instruction_types`), and IFEval tests those same types: a gain over
all its prompts may be the test taught rather than instruction following learnt. So its
prompt-level strict accuracy is reported on three groups of its prompts: those whose every
instruction is of a trained type (`trained`), those with none (`held_out`: what generalised),
and the `mixed` rest -- for the run, its base, and the paired change, each with the promotion
gate's own statistics (eval/scores.py paired_comparison on the group's items: the clustered
standard error, the swap test's 95 % interval and p-value; each group's p-value as it is, not
corrected for the three groups tested beside the dimension).

A prompt's types are its lm-eval document's (TaskItems.instruction_types, kept in items.json),
not looked up by recomputing lm-eval's document hashes from the suite's data: the split stays
right whatever lm-eval hashes.
"""

from __future__ import annotations

from forgeline.eval.dimensions import TaskScore
from forgeline.eval.scores import Z95, TaskItems, interval, paired_comparison

GROUPS = ("trained", "held_out", "mixed")
DIMENSION = "instruction_following"  # the metrics' prefix: IFEval's dimension


def type_group(types: list[str], trained: set[str]) -> str:
    """`trained` when every instruction of a prompt is of a trained type, `held_out` when none
    is, else `mixed`."""
    taught = [kind in trained for kind in types]
    return "trained" if all(taught) else "held_out" if not any(taught) else "mixed"


def group_ids(items: TaskItems, trained: set[str]) -> dict[str, set[str]]:
    """The ids of each group's prompts."""
    groups: dict[str, set[str]] = {group: set() for group in GROUPS}
    for item_id, types in zip(items.ids, items.instruction_types, strict=True):
        groups[type_group(types, trained)].add(item_id)
    return groups


def score_of(items: TaskItems, score: TaskScore) -> dict:
    """The metric's value over `items` with its standard error and 95 % interval (None: no item;
    the error and interval also under two)."""
    if not items.ids:
        return {"score": None, "stderr": None, "ci95": None}
    value, stderr = items.value(score), items.stderr(score)
    return {"score": value, "stderr": stderr, "ci95": interval(value, stderr)}


def change_of(run: TaskItems, base: TaskItems, score: TaskScore) -> dict:
    """The run minus the base, paired on these items, as the gate tests a dimension of this one
    task: the difference, its standard error, the swap test's interval and p-value."""
    versus = paired_comparison({score.task: run}, {score.task: base}, {score.task: [score]})
    return {key: versus["dimensions"][score.task][key] for key in ("difference", "stderr", "ci95", "p_value")}


def instruction_types_report(score: TaskScore, run: TaskItems, base: TaskItems | None,
                             trained: list[str]) -> dict:
    """report.json's `instruction_types`: per group its number of prompts and the run's score,
    and with a base the base's and the paired change; the trained types, and the held-out types
    (those of the evaluated prompts that were not trained)."""
    taught = set(trained)
    section: dict = {"task": score.task, "metric": score.metric}
    for group, ids in group_ids(run, taught).items():
        ours = run.among(ids)
        entry = {"prompts": len(ours.ids)} | score_of(ours, score)
        if base is not None:
            theirs = base.among(ids)
            entry |= {"base": score_of(theirs, score), "versus_base": change_of(ours, theirs, score)}
        section[group] = entry
    seen = {kind for types in run.instruction_types for kind in types}
    section["types"] = {"trained": sorted(taught), "held_out": sorted(seen - taught)}
    return section


def instruction_types_metrics(section: dict) -> dict[str, float]:
    """The section as flat metrics: `instruction_following/<group>_types` and its
    `prompts/`, `stderr/`, `base/`, `base/stderr/`, `versus_base/`, `versus_base/stderr/` and
    `versus_base/p_value/` forms, where they have a value."""
    metrics: dict[str, float | None] = {}
    for group in GROUPS:
        entry, name = section[group], f"{DIMENSION}/{group}_types"
        metrics |= {f"prompts/{name}": entry["prompts"], name: entry["score"],
                    f"stderr/{name}": entry["stderr"]}
        if "base" in entry:
            change = entry["versus_base"]
            metrics |= {f"base/{name}": entry["base"]["score"],
                        f"base/stderr/{name}": entry["base"]["stderr"],
                        f"versus_base/{name}": change["difference"],
                        f"versus_base/stderr/{name}": change["stderr"],
                        f"versus_base/p_value/{name}": change["p_value"]}
    return {key: float(value) for key, value in metrics.items() if value is not None}


GROUP_NAMES = {"trained": "every type trained", "held_out": "no type trained", "mixed": "some types trained"}


def _with_interval(entry: dict) -> str:
    if entry["stderr"] is None:
        return f"{entry['score']:.3f}"
    return f"{entry['score']:.3f} ± {Z95 * entry['stderr']:.3f}"


def _change(change: dict) -> str:
    if change["ci95"] is None:
        return f"{change['difference']:+.3f}"
    low, high = change["ci95"]
    return f"{change['difference']:+.3f} (95 % interval {low:+.3f} to {high:+.3f}, p {change['p_value']:.3g})"


def group_line(group: str, entry: dict) -> str:
    """One group's prompts, score, and with a base the base's and the change."""
    if entry["prompts"] == 0:
        return f"- {GROUP_NAMES[group]}: no prompts"
    line = f"- {GROUP_NAMES[group]}: {entry['prompts']} prompts, {_with_interval(entry)}"
    if "base" in entry:
        line += f"; base {_with_interval(entry['base'])}, change {_change(entry['versus_base'])}"
    return line


def instruction_types_lines(section: dict) -> str:
    """The console's lines under the table: each group's prompts, score, base and change."""
    types = section["types"]
    heading = (f"IFEval {section['metric']} by instruction type ({len(types['trained'])} types trained, "
               f"{len(types['held_out'])} held out):")
    return "\n".join([heading, *(group_line(group, section[group]) for group in GROUPS)])
