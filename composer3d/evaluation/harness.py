"""lm-evaluation-harness tasks scored by a composer3d model: ``composer3d-eval
eval.tasks=[hellaswag,...]``.

lm-eval builds each task's requests and computes its metrics; composer3d answers the requests with
the model in the run's layout (``training.scoring``). Every rank runs lm-eval whole, as if alone
(the adapter reports rank 0 of 1, so lm-eval neither splits the requests nor gathers them): the
ranks hold the same requests, deal them to the data-parallel ranks here, score them together (each
forward is a collective of the whole layout) and exchange the scores; lm-eval computes the metrics
on each node's first process, and rank 0 prints them.

Requests are scored as transformers' model in lm-eval's own ``hf`` backend scores them: the same
tokenization (the tokenizer's special tokens, the prefix token for an empty context), the same
truncation to the last ``train.seq_len`` + 1 tokens, and the same rolling windows for perplexity
tasks. Generation tasks (``generate_until``) decode with ``composer3d.generation`` (the KV cache) in
the layouts composer3d-generate runs: one process, or tensor parallel alone.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from composer3d.config.schema import GenerateConfig
from composer3d.data import IGNORE_INDEX
from composer3d.data.tokenizers import HFTokenizer
from composer3d.errors import ConfigError
from composer3d.generation import generate
from composer3d.parallel.mesh import Layout
from composer3d.training.scoring import layout_logits, target_scores

log = logging.getLogger(__name__)

SCORED_OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")
# a generation task's new tokens when it names none (lm-eval's hf backend's default)
DEFAULT_MAX_GEN_TOKS = 256


def task_manager(eval_cfg) -> TaskManager:
    """lm-eval's index of the tasks: eval.task_paths' own alone when they hold every task named
    (indexing the 14,000 built-in ones takes most of a minute on each rank), else the built-in ones
    with them."""
    paths = list(eval_cfg.task_paths)
    if paths:
        own = TaskManager(include_path=paths, include_defaults=False)
        if all(name in own.task_index for name in eval_cfg.tasks):
            return own
    return TaskManager(include_path=paths or None)


def generation_problem(layout: Layout, sequence_parallel: bool) -> str | None:
    """Why this layout cannot generate (composer3d-generate's layouts: one process, or tensor
    parallel alone without sequence parallel, whose sequence split a growing sequence does not
    keep); None where it can."""
    others = {k: v for k, v in layout.as_dict().items() if k != "tp" and v > 1}
    if others:
        return (
            "generation runs on one process or under tensor parallel alone, and this layout has "
            f"{others}"
        )
    if sequence_parallel:
        return "generation's growing sequence does not split evenly over sequence parallel"
    return None


def check_tasks(
    eval_cfg, manager: TaskManager | None = None, generation: str | None = None
) -> None:
    """Before any worker starts: every task named is one lm-eval knows, and a generation task has a
    layout that generates (``generation``: ``generation_problem``'s answer)."""
    manager = manager or task_manager(eval_cfg)
    for name in eval_cfg.tasks:
        entry = manager.task_index.get(name)
        if entry is None:
            where = (
                f" or in eval.task_paths={list(eval_cfg.task_paths)}" if eval_cfg.task_paths else ""
            )
            raise ConfigError(
                f"eval.tasks: lm-eval has no task, group or tag named {name!r} (among its "
                f"{len(manager.all_tasks)} built-in ones{where}). Run `lm-eval ls tasks` for the "
                "names, or add a directory of task YAMLs with eval.task_paths=[dir]"
            )
        if (entry.cfg or {}).get("output_type") == "generate_until" and generation:
            raise ConfigError(_generation_refused(name, generation))


def _generation_refused(name: str, problem: str) -> str:
    return (
        f"eval.tasks: {name} is a generation task (generate_until), and {problem}. Score it on one "
        "process or under parallel.tp alone with parallel.sequence_parallel=false, or leave "
        f"{name} out"
    )


def run_tasks(trainer, tokenizer, eval_cfg, seq_len: int) -> dict | None:
    """lm-eval's results (per task: its metrics and their standard errors) where lm-eval returns
    them: on each node's first process (LOCAL_RANK 0, rank 0 among them); None elsewhere."""
    model = ComposerLM(trainer, tokenizer, seq_len)
    results = simple_evaluate(
        model=model,
        tasks=list(eval_cfg.tasks),
        task_manager=task_manager(eval_cfg),
        num_fewshot=None if eval_cfg.num_fewshot < 0 else eval_cfg.num_fewshot,
        limit=eval_cfg.limit or None,
        log_samples=bool(eval_cfg.samples_path),
        bootstrap_iters=eval_cfg.bootstrap_iters,
    )
    if results is None:
        return None
    if eval_cfg.samples_path:
        _write_samples(results["samples"], Path(eval_cfg.samples_path))
    return {
        "results": results["results"],
        "n_samples": results.get("n-samples", {}),
        "num_fewshot": results.get("n-shot", {}),
    }


def _write_samples(samples: dict[str, list[dict]], path: Path) -> None:
    """One JSON line per task and document: its id, target, the model's responses (as lm-eval's
    filters left them) and the document's metrics."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for task, documents in samples.items():
            for sample in documents:
                record = {
                    "task": task,
                    "doc_id": sample["doc_id"],
                    "target": sample.get("target"),
                    "responses": sample.get("filtered_resps"),
                    **{
                        metric: sample[metric]
                        for metric in sample.get("metrics", [])
                        if metric in sample
                    },
                }
                out.write(json.dumps(record, default=str) + "\n")


class ComposerLM(TemplateLM):
    """lm-eval's model interface over a Trainer's model in its layout (see the module's
    docstring)."""

    def __init__(self, trainer, tokenizer, seq_len: int):
        super().__init__()
        self.trainer, self.seq_len, self.composer_tokenizer = trainer, seq_len, tokenizer
        self.hf_tokenizer = tokenizer.tokenizer if isinstance(tokenizer, HFTokenizer) else None
        self.rows = trainer.cfg.train.micro_batch_size * (
            trainer.accumulation_steps if trainer.pipeline else 1
        )

    @property
    def eot_token_id(self) -> int:
        return self.composer_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.hf_tokenizer, "bos_token_id", None)
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.hf_tokenizer, "name_or_path", "bytes").replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        if self.hf_tokenizer is None:
            return self.composer_tokenizer.encode(string).tolist()
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        prefix = self.hf_tokenizer.decode(self.prefix_token_id)
        # the text brings its own
        if add_special_tokens is None and prefix and string.startswith(prefix):
            options["add_special_tokens"] = False
        return self.hf_tokenizer.encode(string, **options)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        rows = [self._row(context, continuation) for _, context, continuation in requests]
        return self._score_rows(rows)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.seq_len,
                    context_len=1,
                ),
            ):
                windows.append(self._row(context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score_rows(windows)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued greedily (or sampled, where the task asks) by
        ``composer3d.generation``, batched by equal generation settings; the context left-truncated
        to leave room for the new tokens in train.seq_len, the text decoded without special tokens
        and cut at the first stop sequence (the eos's text among them), as lm-eval's hf backend
        does."""
        problem = generation_problem(
            self.trainer.mesh.layout, self.trainer.cfg.parallel.sequence_parallel
        )
        if problem:
            raise ConfigError(_generation_refused(requests[0].task_name, problem))
        eos = self._decode([self.eot_token_id], skip_special_tokens=False)
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(
                index
            )
        for indices in groups.values():
            options = normalize_gen_kwargs(requests[indices[0]].args[1], DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            new_tokens = options["max_gen_toks"]
            room = self.seq_len - new_tokens
            if room <= 0:
                raise ConfigError(
                    f"train.seq_len: {requests[indices[0]].task_name} generates up to {new_tokens} "
                    f"tokens, which leaves no room for its context in {self.seq_len}. Use "
                    f"train.seq_len>{new_tokens}"
                )
            settings = GenerateConfig(
                max_new_tokens=new_tokens,
                temperature=float(options.get("temperature", 0.0)),
                top_k=int(options.get("top_k") or 0),
                top_p=float(options.get("top_p") or 1.0),
                seed=self.trainer.cfg.train.seed,
                stop_at_eos=True,
                stop=until,
                cache="static",
            )
            for start in range(0, len(indices), self.rows):
                batch = indices[start : start + self.rows]
                prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in batch]
                model = self.trainer.model.eval()
                try:
                    generated = generate(
                        model,
                        prompts,
                        settings,
                        self.eot_token_id,
                        self._decode,
                        self.trainer.device,
                    )
                finally:
                    model.train()
                for i, result in zip(batch, generated):
                    text = self._decode(result.completion_ids, skip_special_tokens=True)
                    results[i] = postprocess_generated_text(text, until, None)
        return results

    def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if self.hf_tokenizer is None:
            return self.composer_tokenizer.decode(ids)
        return self.hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _row(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """(inputs, targets) of one request, seq_len long: the last seq_len + 1 tokens of context +
        continuation, the continuation's tokens as targets (the rest IGNORE_INDEX), right-padded
        (causal: padding after the scored tokens changes nothing before them)."""
        if len(continuation) > self.seq_len:
            raise ConfigError(
                f"train.seq_len: a continuation of {len(continuation)} tokens does not fit a "
                f"window of {self.seq_len}. Use train.seq_len>={len(continuation)}"
            )
        whole = (context + continuation)[-(self.seq_len + 1) :]
        inputs = whole[:-1]
        targets = [IGNORE_INDEX] * (len(inputs) - len(continuation)) + continuation
        padding = self.seq_len - len(inputs)
        return inputs + [self.eot_token_id] * padding, targets + [IGNORE_INDEX] * padding

    @torch.no_grad()
    def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(summed log-probability, greedy) of every row: dealt round-robin to the data-parallel
        ranks, the same number of forwards on each (padded with rows that score nothing), then
        exchanged."""
        mesh = self.trainer.mesh
        dp, dp_rank = mesh.layout.dp, mesh.dp_rank
        mine = list(range(dp_rank, len(rows), dp))
        per_rank = -(-len(rows) // dp)
        forwards = -(-per_rank // self.rows)
        blank = ([self.eot_token_id] * self.seq_len, [IGNORE_INDEX] * self.seq_len)
        scores: dict[int, tuple[float, bool]] = {}
        model = self.trainer.model.eval()
        try:
            for start in range(0, forwards * self.rows, self.rows):
                batch = mine[start : start + self.rows]
                chunk = [rows[i] for i in batch] + [blank] * (self.rows - len(batch))
                inputs = torch.tensor([inputs for inputs, _ in chunk])
                targets = torch.tensor(
                    [targets for _, targets in chunk], device=self.trainer.device
                )
                logprobs, greedy = target_scores(layout_logits(self.trainer, inputs), targets)
                for i, logprob, is_greedy in zip(batch, logprobs.tolist(), greedy.tolist()):
                    scores[i] = (logprob, is_greedy)
        finally:
            model.train()
        everyone: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, scores)
        for theirs in everyone:
            scores.update(theirs)
        return [scores[i] for i in range(len(rows))]
