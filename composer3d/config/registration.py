"""What Hydra needs before it composes a config: the schema in its ConfigStore (``train_schema``,
which conf/train.yaml lists first) and composer3d's resolvers."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from composer3d.config.help import banner, config_groups, examples, key_help, recipes
from composer3d.config.schema import TrainConfig


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    # run.dir's default: the run's name where it has one, else the timestamp
    OmegaConf.register_new_resolver(
        "composer3d.run_subdir",
        lambda name, timestamp: timestamp if name is None else name,
        replace=True,
    )
    # --help (hydra.help.template)
    OmegaConf.register_new_resolver("composer3d.key_help", key_help, replace=True)
    OmegaConf.register_new_resolver("composer3d.recipes", recipes, replace=True)
    OmegaConf.register_new_resolver("composer3d.config_groups", config_groups, replace=True)
    OmegaConf.register_new_resolver("composer3d.banner", banner, replace=True)
    OmegaConf.register_new_resolver("composer3d.examples", examples, replace=True)
