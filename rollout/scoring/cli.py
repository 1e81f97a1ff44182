"""Score the completions of a dataset: per-token logprobs under a model, through rollout's engine.

Reads a jsonl, json, csv or parquet file with ``datasets``, tokenizes each (prompt, completion) pair,
scores the completion tokens with ``rollout.scoring.offline.score`` (prefill-only requests packed into the
engine's token budget, completions of one prompt sharing its cached KV blocks), and writes the input
columns plus

- ``completion_logprobs``: list of floats, one per completion token, in nats;
- ``completion_logprob_sum``: their sum;
- ``completion_num_tokens``: the number of completion tokens;

to a jsonl or parquet file (by extension). A null completion cell (csv's empty cell) is an empty
completion: zero tokens, sum 0.0. Rows skipped with ``--skip-too-long`` get nulls in the
three columns.

Tokenization: the prompt text alone, and prompt + ``--separator`` + completion as one text; the completion's
tokens (the separator's included) are the joint tokens after the prompt's. The default separator is none (TRL's
rule: "2+2=" and "4" score "4" right after "="); when no prompt ends and no completion starts with whitespace, a
warning names ``--separator`` and ``--chat-template``. A row whose joint tokens do not start with the prompt's (a
merge across the boundary) has its completion tokenized on its own, counted in a warning. With ``--chat-template``
the prompt is the chat template of one user message with the assistant turn opened, and the completion is appended
as the reply (no end-of-turn token). A prompt that already starts with the BOS text gets no second BOS.

Errors in the input (a missing, empty, blank or unreadable file, no rows, a missing or all-empty column, a non-text
cell, a row longer than the model's context) exit with status 1 and a one-line message; bad flags with status 2.

Example (``rollout-score`` is the same as ``python scripts/score_dataset.py``):
    rollout-score --dataset data.jsonl --prompt-column prompt \
        --completion-column completion --output scored.parquet --chat-template

Tensor parallelism: under ``torchrun --nproc_per_node N``, ``--tp`` loads the model with
``tp_plan="auto"`` (each rank holds 1/N of the weights and of the KV heads, which must divide by N);
every rank reads and tokenizes the file, and rank 0 alone writes the output and prints:
    torchrun --nproc_per_node 2 scripts/score_dataset.py --tp --dataset data.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

    from rollout.scoring.offline import ScoreOutput

# datasets, torch, transformers and the engine are imported once the flags are parsed (in the functions that use them):
# a bad flag is answered at once, not after the seconds torch takes to import.

INPUT_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
OUTPUT_FORMATS = (".jsonl", ".parquet")
OUTPUT_COLUMNS = ("completion_logprobs", "completion_logprob_sum", "completion_num_tokens")
DEFAULT_MODEL = "smollm2-135m-instruct"

logger = logging.getLogger(__name__)


class ScoreDatasetError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""


# ----------------------------------------------------------------------------------------------- reading


def read_dataset(path: str | Path) -> datasets.Dataset:
    """Load a jsonl, json, csv or parquet file as a ``datasets.Dataset``.

    Raises:
        ScoreDatasetError: the file does not exist, its extension is not supported, or
            ``datasets`` cannot parse it (the message carries the parser's reason).
    """
    path = Path(path)
    fmt = INPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ScoreDatasetError(
            f"cannot read {path}: unsupported extension {path.suffix or '(none)'!r}; use one of {sorted(INPUT_FORMATS)}"
        )
    if not path.is_file():
        raise ScoreDatasetError(f"dataset file {path} does not exist")
    if path.stat().st_size == 0:
        raise ScoreDatasetError(f"dataset file {path} is empty: there are no rows to score")
    if fmt != "parquet" and _only_whitespace(path):
        raise ScoreDatasetError(f"dataset file {path} holds only blank lines: there are no rows to score")
    import datasets

    ds_logger = logging.getLogger("datasets")
    level = ds_logger.level
    ds_logger.setLevel(logging.CRITICAL)  # datasets logs its own copy of the parse error
    try:
        ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as e:  # any parser failure is a problem of the user's file
        reason = str(e.__cause__ or e).strip().splitlines()
        raise ScoreDatasetError(f"cannot read {path} as {fmt}: {reason[0] if reason else type(e).__name__}") from e
    finally:
        ds_logger.setLevel(level)
    if len(ds) == 0:
        raise ScoreDatasetError(f"dataset file {path} has no rows (columns: {', '.join(ds.column_names) or 'none'})")
    return ds


def _only_whitespace(path: Path, chunk: int = 1 << 20) -> bool:
    with path.open("rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            if block.strip():
                return False
    return True


def check_columns(column_names: Sequence[str], wanted: Sequence[str], path: str | Path) -> None:
    """Raise ScoreDatasetError listing the columns present when one of ``wanted`` is missing."""
    missing = [c for c in wanted if c not in column_names]
    if missing:
        raise ScoreDatasetError(
            f"column {missing[0]!r} not found in {path}; columns present: {', '.join(column_names) or '(none)'}"
        )


def _texts(values: Sequence, column: str, null_is_empty: bool = False) -> list[str]:
    """The cells of a text column.

    With ``null_is_empty`` a null cell (what csv gives for an empty cell) reads as "".

    Raises:
        ScoreDatasetError: a non-text cell (named), or a column that is empty or null in every row.
    """
    if all(v is None or v == "" for v in values):
        raise ScoreDatasetError(f"column {column!r} is empty in every row: nothing to score (wrong column?)")
    out = []
    for i, v in enumerate(values):
        if v is None and null_is_empty:
            v = ""
        if not isinstance(v, str):
            raise ScoreDatasetError(f"row {i}: column {column!r} holds {type(v).__name__} {v!r}, expected text")
        out.append(v)
    return out


# ----------------------------------------------------------------------------------------------- tokenizing


def _ids(ids: Sequence[int]) -> list[int]:
    return [int(t) for t in ids]


def chat_prompt_text(tokenizer, prompt: str) -> str:
    """The chat template of one user message with the assistant turn opened, as text.

    Raises:
        ScoreDatasetError: the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ScoreDatasetError("--chat-template was given but the model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )


def tokenize_rows(
    tokenizer, prompts: Sequence[str], completions: Sequence[str], chat_template: bool = False, separator: str = ""
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Token ids of each (prompt, completion) pair, by the rule of the module docstring's "Tokenization".

    A completion tokenized on its own (joint ids that do not start with the prompt's) gets no special tokens.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        prompts: N prompt texts (user messages with ``chat_template``).
        completions: N completion texts.
        chat_template: render each prompt as a user message with the assistant turn opened; the
            template's own special tokens are used and no others are added.
        separator: text put between each prompt and its completion ("" joins them as they are).

    Returns:
        (prompt_ids, completion_ids, fallback_rows): two lists of N id lists, and the indices of the
        rows tokenized separately.
    """
    if chat_template:
        prompt_texts = [chat_prompt_text(tokenizer, p) for p in prompts]
    else:
        prompt_texts = list(prompts)
    tails = [separator + c for c in completions]
    bos = tokenizer.bos_token
    prompt_ids: list[list[int]] = []
    completion_ids: list[list[int]] = []
    fallback: list[int] = []
    for i, (prompt, tail) in enumerate(zip(prompt_texts, tails)):
        # The chat template writes its own special tokens; a text that starts with BOS has one already.
        special = not chat_template and not (bos and prompt.startswith(bos))
        p = _ids(tokenizer(prompt, add_special_tokens=special)["input_ids"])
        j = _ids(tokenizer(prompt + tail, add_special_tokens=special)["input_ids"])
        prompt_ids.append(p)
        if j[: len(p)] == p:
            completion_ids.append(j[len(p) :])
        else:
            fallback.append(i)
            completion_ids.append(_ids(tokenizer(tail, add_special_tokens=False)["input_ids"]))
    return prompt_ids, completion_ids, fallback


def warn_if_joined_without_space(prompts: Sequence[str], completions: Sequence[str]) -> bool:
    """Warn (once) when no prompt ends and no completion starts with whitespace: the texts run together.

    Returns:
        True when it warned.
    """
    for p, c in zip(prompts, completions):
        if p[-1:].isspace() or c[:1].isspace() or not c:
            return False
    example = (prompts[0][-30:] + completions[0][:30]).replace("\n", "\\n")
    logger.warning(
        "no prompt ends and no completion starts with whitespace, so they are joined as '...%s...'; "
        "pass --separator ' ' (or '\\n'), or --chat-template for chat models",
        example,
    )
    return True


# ----------------------------------------------------------------------------------------------- writing


def write_output(ds: datasets.Dataset, results: Sequence[ScoreOutput], path: str | Path) -> None:
    """Write the dataset's columns plus the three score columns to a jsonl or parquet file.

    Args:
        ds: the input ``datasets.Dataset`` (N rows).
        results: N ``ScoreOutput``; skipped rows get nulls.
        path: output file; ``.jsonl`` or ``.parquet``; parent folders are created.
    """
    path = Path(path)
    scores = [  # per row, the values of OUTPUT_COLUMNS
        (None, None, None) if r.skipped else (r.completion_logprobs, r.logprob_sum, r.num_tokens) for r in results
    ]
    existing = [c for c in OUTPUT_COLUMNS if c in ds.column_names]
    if existing:
        logger.warning("overwriting the input columns %s", existing)
        ds = ds.remove_columns(existing)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".parquet":
        for k, column in enumerate(OUTPUT_COLUMNS):
            ds = ds.add_column(column, [row_scores[k] for row_scores in scores])
        ds.to_parquet(str(path))
        return
    # jsonl written here rather than with Dataset.to_json, whose pandas writer rounds floats.
    with path.open("w", encoding="utf-8") as f:
        for row, row_scores in zip(ds, scores):
            row = {**row, **dict(zip(OUTPUT_COLUMNS, row_scores))}
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")


# ----------------------------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; argparse exits with status 2 on a bad flag."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model folder or alias (default {DEFAULT_MODEL})")
    p.add_argument("--dataset", required=True, type=Path, help="input file: .jsonl, .json, .csv or .parquet")
    p.add_argument("--prompt-column", required=True, help="column holding the prompt text")
    p.add_argument("--completion-column", required=True, help="column holding the completion text")
    p.add_argument("--output", required=True, type=Path, help="output file: .jsonl or .parquet")
    p.add_argument("--chat-template", action="store_true", help="render each prompt as a chat user message")
    p.add_argument(
        "--separator",
        default="",
        help="text between prompt and completion, scored as part of the completion (default: none, the texts "
        "are joined as they are); not with --chat-template",
    )
    p.add_argument("--batch-tokens", type=_positive_int, default=None, help="token budget of one engine step")
    p.add_argument("--skip-too-long", action="store_true", help="write nulls for rows longer than the context")
    p.add_argument("--temperature", type=_positive_float, default=1.0, help="divide the logits by this (default 1)")
    p.add_argument("--device", default="cpu", help="torch device of the model (default cpu)")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="score with the batch-invariant kernels: each logprob bitwise equal to a trainer's forward inside "
        "rollout.batch_invariant() (float32 on CPU; ContinuousBatchingConfig.batch_invariant)",
    )
    p.add_argument(
        "--tp",
        action="store_true",
        help="shard the model over the processes of a torchrun launch (tp_plan='auto'; --device is then ignored)",
    )
    args = p.parse_args(argv)
    if args.tp and int(os.environ.get("WORLD_SIZE", "1") or "1") < 2:
        p.error(
            "--tp shards the model over the processes of a torchrun launch: run it under torchrun --nproc_per_node N"
        )
    if args.chat_template and args.separator:
        # The chat template decides what lies between the prompt and the assistant's reply (the opened
        # assistant turn); a separator on top would be scored as the start of every reply.
        p.error(
            "--separator and --chat-template cannot be combined: with --chat-template the completion follows "
            "the opened assistant turn as it is; drop --separator"
        )
    if args.output.suffix.lower() not in OUTPUT_FORMATS:
        p.error(f"--output must end with one of {', '.join(OUTPUT_FORMATS)}, got {str(args.output)!r}")
    return args


def run(args: argparse.Namespace) -> int | None:
    """Read, tokenize, score and write; returns the number of rows written (None on a tensor-parallel rank
    other than rank 0, which writes nothing).

    Raises:
        ScoreDatasetError, ValueError, OSError, RuntimeError: reported by ``main`` as one line.
    """
    ds = read_dataset(args.dataset)
    check_columns(ds.column_names, [args.prompt_column, args.completion_column], args.dataset)
    prompts = _texts(ds[args.prompt_column], args.prompt_column)
    completions = _texts(ds[args.completion_column], args.completion_column, null_is_empty=True)
    from rollout.config import ContinuousBatchingConfig
    from rollout.engine import is_driver_rank
    from rollout.scoring.offline import score
    from rollout.weights.loading import load_model
    from rollout.weights.model_info import model_context_length

    model, tokenizer = load_model(args.model, device=args.device, tp_plan="auto" if args.tp else None)
    if not is_driver_rank(model):  # a tensor-parallel rank other than rank 0 computes, but says nothing
        logging.getLogger().setLevel(logging.ERROR)
    if not args.chat_template and not args.separator:
        warn_if_joined_without_space(prompts, completions)
    prompt_ids, completion_ids, fallback = tokenize_rows(
        tokenizer, prompts, completions, args.chat_template, args.separator
    )
    if fallback:
        logger.warning(
            "%d of %d rows (first: row %d): the tokens of prompt + completion do not start with the prompt's "
            "tokens; their completions were tokenized separately",
            len(fallback),
            len(prompts),
            fallback[0],
        )
    context = model_context_length(model)
    if context is not None and not args.skip_too_long:
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            if len(p) + len(c) > context:
                raise ScoreDatasetError(
                    f"row {i} has {len(p)} prompt + {len(c)} completion tokens, more than the model's context of "
                    f"{context} tokens; pass --skip-too-long to skip such rows"
                )
    results = score(
        model,
        prompt_ids,
        completion_ids,
        batch_tokens=args.batch_tokens,
        temperature=args.temperature,
        skip_too_long=args.skip_too_long,
        progress_bar=True,
        continuous_batching_config=ContinuousBatchingConfig(batch_invariant=True) if args.batch_invariant else None,
    )
    if not is_driver_rank(model):  # rank 0 of a tensor-parallel launch has the scores and writes them
        return None
    num_skipped = sum(r.skipped for r in results)
    if num_skipped:
        logger.warning("%d rows longer than the model's context were skipped (null scores)", num_skipped)
    write_output(ds, results, args.output)
    return len(results)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit status (0 ok, 1 bad input; argparse exits 2 on bad flags)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    args = parse_args(argv)
    import datasets
    import torch.distributed as dist
    import transformers

    # The scoring bar is the one that matters: silence the loading bars, and restore them after.
    hf_bars = transformers.utils.logging.is_progress_bar_enabled()
    ds_bars = datasets.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        n = run(args)
    except (ScoreDatasetError, ValueError, OSError, RuntimeError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 1
    finally:
        if hf_bars:
            transformers.utils.logging.enable_progress_bar()
        if ds_bars:
            datasets.enable_progress_bars()
        if args.tp and dist.is_initialized():  # an orderly end: gloo aborts a process that exits with open groups
            dist.destroy_process_group()
    if n is not None:
        print(f"wrote {n} rows to {args.output}", file=sys.stderr)
    return 0
