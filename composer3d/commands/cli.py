"""The console scripts (pyproject.toml's ``[project.scripts]``): each command's name, what it
does, its examples, the config sections it reads (what its ``--help`` lists) and the module that
does its work. Importing this costs Hydra and the schema, not torch (``hydra_entry``)."""

from __future__ import annotations

from dataclasses import fields

from composer3d.commands.hydra_entry import Command, hydra_entry_point
from composer3d.config.schema import TrainConfig
from composer3d.launch.process_exit import ending_the_process

# the model, its data and its layout: what a command that builds (or plans) the model reads
_MODEL_AND_LAYOUT = ("model", "data", "parallel", "precision", "memory", "compile", "peft")
# composer3d-train reads every section but the generator's
_TRAINED = tuple(f.name for f in fields(TrainConfig) if f.name != "generate")

TRAIN = Command(
    name="composer3d-train",
    module="composer3d.commands.train",
    about="train a model under any parallel layout (FSDP2, TP/SP, PP, EP, CP)",
    examples=(
        "composer3d-train launch.nproc_per_node=2 train.steps=100",
        "composer3d-train recipe=llama3_1_8b model.path=/models/Llama-3.1-8B",
        "composer3d-train -m optim.lr=1e-4,3e-4   (a sweep: job N in <run.dir>/N; "
        "hydra/launcher=slurm submits)",
    ),
    sections=_TRAINED,
)

EVALUATE = Command(
    name="composer3d-eval",
    module="composer3d.commands.evaluate",
    about="mean next-token loss and perplexity over a text file (eval.path), or lm-eval tasks "
    "(eval.tasks)",
    examples=(
        "composer3d-eval checkpoint.resume=<run>/checkpoints/step-N eval.path=valid.txt   (the "
        "checkpoint's own model)",
        "composer3d-eval model=hf model.path=/models/qwen eval.path=valid.txt train.seq_len=2048",
        "composer3d-eval model=hf model.path=/models/qwen 'eval.tasks=[hellaswag,arc_easy]' "
        "eval.num_fewshot=0",
    ),
    sections=(*_MODEL_AND_LAYOUT, "train", "eval", "checkpoint", "launch"),
)

GENERATE = Command(
    name="composer3d-generate",
    module="composer3d.commands.generate",
    about="continue prompts (generate.prompt, generate.prompts) with a checkpoint's model or a "
    "Hugging Face model",
    examples=(
        "composer3d-generate checkpoint.resume=<run>/checkpoints/step-N "
        'generate.prompt="def main("',
        'composer3d-generate model=hf model.path=/models/qwen generate.prompt="The capital of '
        'France is"',
    ),
    sections=(*_MODEL_AND_LAYOUT, "generate", "checkpoint", "launch"),
)

PLAN = Command(
    name="composer3d-plan",
    module="composer3d.commands.plan",
    about="memory and step time of parallel layouts on a cluster (cluster.*, plan.*); starts "
    "nothing",
    examples=(
        "composer3d-plan model=llama3_8b train.seq_len=8192 cluster.nodes=8 cluster.device=h100   "
        "(the layouts that fit)",
        "composer3d-plan model=llama3_8b parallel.tp=2 parallel.dp_shard=-1   (one layout, in "
        "detail)",
        "composer3d-plan model=llama3_8b cluster.gpus_per_node=1 plan.what_fits=true",
        "composer3d-plan model=llama3_8b parallel.tp=2 parallel.dp_shard=-1 plan.measure=true   "
        "(rank 0, run here)",
        "composer3d-plan model=llama3_8b parallel.dp_shard=8 plan.calibrate=h200.json   (its "
        "kernels timed here; then plan with plan.calibration=h200.json cluster.device=h200)",
    ),
    sections=(*_MODEL_AND_LAYOUT, "train", "optim", "launch", "cluster", "plan"),
)

PREPARE = Command(
    name="composer3d-prepare",
    module="composer3d.commands.prepare",
    about="tokenize a corpus once into token shards (data.prepared) that composer3d-train maps",
    examples=(
        "composer3d-prepare data=text_files data.paths=[corpus/*.jsonl] data.tokenizer=tok "
        "data.prepared=corpus.prepared",
        "composer3d-train data=text_files data.tokenizer=tok data.prepared=corpus.prepared   "
        "(then train on them)",
    ),
    sections=("model", "data"),
)

COMMANDS = (TRAIN, EVALUATE, GENERATE, PLAN, PREPARE)

# each command's entry point by its module (what `python -m <module>` runs; the tests call it in
# their own process)
SCRIPTS = {command.module: hydra_entry_point(command) for command in COMMANDS}
# the console scripts, and each module's `__main__`: the entry point, then the process ends without
# the interpreter's teardown (launch/process_exit.py)
train, evaluate, generate, plan, prepare = map(ending_the_process, SCRIPTS.values())
