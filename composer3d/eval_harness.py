"""lm-evaluation-harness tasks scored by a composer3d model: ``composer3d-eval eval.tasks=[hellaswag,...]``.

lm-eval builds each task's requests and computes its metrics; composer3d answers the requests with the model in
the run's layout (``training.scoring``). Every rank runs lm-eval whole, as if alone (the adapter reports rank 0 of
1, so lm-eval neither splits the requests nor gathers them): the ranks hold the same requests, deal them to the
data-parallel ranks here, score them together (each forward is a collective of the whole layout) and exchange the
scores; lm-eval computes the metrics on each node's first process, and rank 0 prints them.

Requests are scored as transformers' model in lm-eval's own ``hf`` backend scores them: the same tokenization
(the tokenizer's special tokens, the prefix token for an empty context), the same truncation to the last
``train.seq_len`` + 1 tokens, and the same rolling windows for perplexity tasks. Generation tasks
(``generate_until``) are refused: composer3d-eval scores, ``composer3d-generate`` generates.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from composer3d.data import IGNORE_INDEX
from composer3d.data.tokenizers import HFTokenizer
from composer3d.errors import ConfigError
from composer3d.training.scoring import layout_logits, target_scores

log = logging.getLogger(__name__)

SCORED_OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")


def task_manager(eval_cfg) -> TaskManager:
    """lm-eval's index of the tasks: eval.task_paths' own alone when they hold every task named (indexing the
    14,000 built-in ones takes most of a minute on each rank), else the built-in ones with them."""
    paths = list(eval_cfg.task_paths)
    if paths:
        own = TaskManager(include_path=paths, include_defaults=False)
        if all(name in own.task_index for name in eval_cfg.tasks):
            return own
    return TaskManager(include_path=paths or None)


def check_tasks(eval_cfg, manager: TaskManager | None = None) -> None:
    """Before any worker starts: every task named is one lm-eval knows, and none asks for generation."""
    manager = manager or task_manager(eval_cfg)
    for name in eval_cfg.tasks:
        entry = manager.task_index.get(name)
        if entry is None:
            where = f" or in eval.task_paths={list(eval_cfg.task_paths)}" if eval_cfg.task_paths else ""
            raise ConfigError(f"eval.tasks: lm-eval has no task, group or tag named {name!r} (among its "
                              f"{len(manager.all_tasks)} built-in ones{where}). Run `lm-eval ls tasks` for the names, "
                              "or add a directory of task YAMLs with eval.task_paths=[dir]")
        output_type = (entry.cfg or {}).get("output_type")
        if output_type is not None and output_type not in SCORED_OUTPUT_TYPES:
            raise ConfigError(_generation_refused(name, output_type))


def _generation_refused(name: str, output_type: str) -> str:
    return (f"eval.tasks: {name} is a {output_type} task; composer3d-eval scores the likelihood of given text "
            f"({', '.join(SCORED_OUTPUT_TYPES)}) and does not generate. Leave {name} out")


def run_tasks(trainer, tokenizer, eval_cfg, seq_len: int) -> dict | None:
    """lm-eval's results (per task: its metrics and their standard errors) where lm-eval returns them: on each
    node's first process (LOCAL_RANK 0, rank 0 among them); None elsewhere."""
    model = ComposerLM(trainer, tokenizer, seq_len)
    results = simple_evaluate(model=model, tasks=list(eval_cfg.tasks), task_manager=task_manager(eval_cfg),
                              num_fewshot=None if eval_cfg.num_fewshot < 0 else eval_cfg.num_fewshot,
                              limit=eval_cfg.limit or None, log_samples=False, bootstrap_iters=eval_cfg.bootstrap_iters)
    if results is None:
        return None
    return {"results": results["results"], "n_samples": results.get("n-samples", {}),
            "num_fewshot": results.get("n-shot", {})}


class ComposerLM(TemplateLM):
    """lm-eval's model interface over a Trainer's model in its layout (see the module's docstring)."""

    def __init__(self, trainer, tokenizer, seq_len: int):
        super().__init__()
        self.trainer, self.seq_len, self.composer_tokenizer = trainer, seq_len, tokenizer
        self.hf_tokenizer = tokenizer.tokenizer if isinstance(tokenizer, HFTokenizer) else None
        self.rows = trainer.cfg.train.micro_batch_size * (trainer.accumulation_steps if trainer.pipeline else 1)

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

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if self.hf_tokenizer is None:
            return self.composer_tokenizer.encode(string).tolist()
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        prefix = self.hf_tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and prefix and string.startswith(prefix):  # the text brings its own
            options["add_special_tokens"] = False
        return self.hf_tokenizer.encode(string, **options)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows = [self._row(context, continuation) for _, context, continuation in requests]
        return self._score_rows(rows)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.seq_len,
                    context_len=1)):
                windows.append(self._row(context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score_rows(windows)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise ConfigError(_generation_refused(requests[0].task_name, "generate_until"))

    def _row(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """(inputs, targets) of one request, seq_len long: the last seq_len + 1 tokens of context + continuation,
        the continuation's tokens as targets (the rest IGNORE_INDEX), right-padded (causal: padding after the
        scored tokens changes nothing before them)."""
        if len(continuation) > self.seq_len:
            raise ConfigError(f"train.seq_len: a continuation of {len(continuation)} tokens does not fit a window "
                              f"of {self.seq_len}. Use train.seq_len>={len(continuation)}")
        whole = (context + continuation)[-(self.seq_len + 1):]
        inputs = whole[:-1]
        targets = [IGNORE_INDEX] * (len(inputs) - len(continuation)) + continuation
        padding = self.seq_len - len(inputs)
        return inputs + [self.eot_token_id] * padding, targets + [IGNORE_INDEX] * padding

    @torch.no_grad()
    def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(summed log-probability, greedy) of every row: dealt round-robin to the data-parallel ranks, the same
        number of forwards on each (padded with rows that score nothing), then exchanged."""
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
                batch = mine[start:start + self.rows]
                chunk = [rows[i] for i in batch] + [blank] * (self.rows - len(batch))
                inputs = torch.tensor([inputs for inputs, _ in chunk])
                targets = torch.tensor([targets for _, targets in chunk], device=self.trainer.device)
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
