"""composer3d-eval eval.tasks: lm-evaluation-harness tasks scored by composer3d under several
layouts, against lm-eval's own Hugging Face backend (transformers) on the same model and tasks.
Local tasks, nothing downloaded."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
from harness import command_output
from hf_models import make_model
from test_eval import EVAL, evaluated

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
SEQ = 32  # test_eval's window: long texts take several rolling windows

QUESTIONS = [
    ("the quick brown", [" fox", " dog", " matmul"], 0),
    ("pipeline parallel splits", [" layers", " checkpoints", " the fox"], 0),
    ("a checkpoint written by one layout", [" can be read back", " jumps over", " splits"], 0),
    ("fully sharded data parallel keeps", [" one shard", " the lazy dog", " data"], 1),
    ("def train(model,", [" data):", " fox", " rank"], 0),
]
TEXTS = [
    "the quick brown fox jumps over the lazy dog " * 6,
    "tensor parallel splits each matmul while pipeline parallel splits layers across ranks",
    "def train(model, data):\n    for batch in data:\n        loss = model(batch)\n" * 3,
]
TASKS = ["c3d_choice", "c3d_next_words", "c3d_rolling"]
GENERATION = "c3d_generate"  # greedy, 8 new tokens, stopped at "fox"


def write_tasks(root) -> str:
    """Three local tasks, one per scored request type: multiple choice, loglikelihood, rolling
    loglikelihood."""
    root.mkdir()
    (root / "choice.jsonl").write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = "dataset_path: json\ntest_split: train\nmetadata:\n  version: 1.0\n"
    (root / "choice.yaml").write_text(
        f"task: c3d_choice\n{common}dataset_kwargs:\n  data_files: {root / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "next_words.yaml").write_text(
        f"task: c3d_next_words\n{common}dataset_kwargs:\n  data_files: {root / 'texts.jsonl'}\n"
        'output_type: loglikelihood\ndoc_to_text: \'{{text.split(" ")[:-2] | join(" ")}}\'\n'
        'doc_to_target: \'{{" " + text.split(" ")[-2:] | join(" ")}}\'\n'
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n"
    )
    (root / "rolling.yaml").write_text(
        f"task: c3d_rolling\n{common}dataset_kwargs:\n  data_files: {root / 'texts.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: "
        "bits_per_byte\n"
    )
    (root / "generate.yaml").write_text(
        f"task: c3d_generate\n{common}dataset_kwargs:\n  data_files: {root / 'texts.jsonl'}\n"
        'output_type: generate_until\ndoc_to_text: \'{{text.split(" ")[:4] | join(" ")}}\'\n'
        'doc_to_target: \'{{" " + text.split(" ")[4:6] | join(" ")}}\'\n'
        'generation_kwargs:\n  until: ["fox"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return str(root)


def reference(model_dir, tasks_dir) -> dict:
    """lm-eval's own `hf` backend (transformers' forward) on the same model and tasks."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="hf",
        model_args={
            "pretrained": str(model_dir),
            "dtype": "float32",
            "device": "cpu",
            "max_length": SEQ,
            "batch_size": 2,
        },
        tasks=[*TASKS, GENERATION],
        task_manager=TaskManager(include_path=tasks_dir),
        log_samples=True,
        bootstrap_iters=0,
    )
    generated = [sample["resps"][0][0] for sample in results["samples"][GENERATION]]
    return results["results"], generated


@pytest.fixture(scope="module")
def model_and_tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    model_dir = make_model(root / "model", "llama")
    tasks_dir = write_tasks(root / "tasks")
    return model_dir, tasks_dir, reference(model_dir, tasks_dir)


def _metrics(results: dict) -> dict:
    return {
        (task, name): value
        for task, metrics in results.items()
        for name, value in metrics.items()
        if "," in name and "stderr" not in name
    }


@pytest.mark.parametrize(
    "nproc,layout,tasks",
    [  # each gathers the logits its own way: vocabulary, stages, sequence
        (4, ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true"], TASKS),
        (4, ["parallel.pp=2", "parallel.dp_shard=2"], TASKS),
        (4, ["parallel.cp=2", "parallel.dp_shard=2"], TASKS),
        (2, ["parallel.tp=2"], [*TASKS, GENERATION]),  # generation: composer3d-generate's layouts
    ],
)
def test_tasks_score_as_lm_eval_scores_transformers(model_and_tasks, nproc, layout, tasks):
    model_dir, tasks_dir, (want, _) = model_and_tasks
    got = evaluated(
        "model=hf",
        f"model.path={model_dir}",
        f"eval.tasks=[{','.join(tasks)}]",
        f"eval.task_paths=[{tasks_dir}]",
        "eval.bootstrap_iters=0",
        *layout,
        nproc=nproc,
    )
    assert got["n_samples"]["c3d_choice"]["effective"] == len(QUESTIONS)
    got, want = _metrics(got["results"]), {k: v for k, v in _metrics(want).items() if k[0] in tasks}
    assert set(got) == set(want) and len(got) == 7 + (GENERATION in tasks), (
        sorted(got),
        sorted(want),
    )
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, got[key], value)
    # The model is random: the scores are not at a trivial value (all right, or the same for every
    # choice).
    assert 0 < want[("c3d_choice", "acc,none")] < 1 or want[("c3d_choice", "acc_norm,none")] < 1


def test_generation_continues_each_prompt_as_transformers_generate_does(model_and_tasks, tmp_path):
    """The texts the generation task scored: composer3d's cached greedy decoding against lm-eval's
    hf backend (transformers' generate), cut at the task's stop sequence; written per document to
    eval.samples_path."""
    model_dir, tasks_dir, (_, want) = model_and_tasks
    assert len(want) == len(TEXTS) and any(text for text in want), want
    samples = tmp_path / "samples.jsonl"
    evaluated(
        "model=hf",
        f"model.path={model_dir}",
        f"eval.tasks=[{GENERATION}]",
        f"eval.task_paths=[{tasks_dir}]",
        "eval.bootstrap_iters=0",
        f"eval.samples_path={samples}",
        nproc=1,
    )
    records = sorted(
        (json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"]
    )
    assert [r["responses"][0] for r in records] == want


def test_generation_and_unknown_tasks_are_refused_before_workers(model_and_tasks):
    from lm_eval.tasks import TaskManager
    from omegaconf import OmegaConf

    from composer3d.errors import ConfigError
    from composer3d.evaluation.harness import check_tasks

    model_dir, tasks_dir, _ = model_and_tasks
    proc = command_output(
        "composer3d.commands.evaluate",
        *EVAL,
        "model=hf",
        f"model.path={model_dir}",
        f"eval.task_paths=[{tasks_dir}]",
        "eval.tasks=[c3d_generate]",
        "parallel.dp_shard=2",
        "launch.nproc_per_node=2",
    )
    refusal = (
        "eval.tasks: c3d_generate is a generation task (generate_until), and generation runs on "
        "one process or under tensor parallel alone, and this layout has {'dp_shard': 2}"
    )
    assert proc.returncode == 2 and proc.stderr.count(refusal) == 1, proc.stderr
    # The same check the launcher makes, over the local tasks alone (indexing lm-eval's 14,000 takes
    # a minute here)
    unknown = OmegaConf.create({"tasks": ["c3d_no_such_task"], "task_paths": [tasks_dir]})
    with pytest.raises(
        ConfigError, match="eval.tasks: lm-eval has no task, group or tag named 'c3d_no_such_task'"
    ):
        check_tasks(unknown, TaskManager(include_path=tasks_dir, include_defaults=False))
