"""``pipeloom plan --export torchtitan`` against torchtitan's own configuration classes and parser (skipped
when torchtitan is not installed; pipeloom does not depend on it).

torchtitan 0.2.x: its ``ConfigManager`` reads the exported TOML (``--job.config_file``) and the exported
command-line overrides into its ``JobConfig``, and refuses 0.3.x's extra option. torchtitan 0.3.x: its tyro
rules parse the overrides into its ``TrainingConfig``/``ParallelismConfig`` sections (into the whole
``Trainer.Config`` when that imports, whose checks refuse pipeline parallelism with CUDA graphs on)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import shlex
from pathlib import Path

import pytest

torchtitan = pytest.importorskip("torchtitan")
tyro = pytest.importorskip("tyro")

from pipeloom.plan import CostTable, Piece, PlanError, plan_mesh  # noqa: E402 (after the skips)
from pipeloom.plan.export.torchtitan import TORCHTITAN_03_SETTINGS, torchtitan_overrides, write_torchtitan  # noqa: E402

VERSION = importlib.metadata.version("torchtitan")
MODULES = ["tok_embeddings", *(f"layers.{k}" for k in range(8)), "norm", "output"]  # torchtitan's LLaMA names


def _export(tmp_path: Path, schedule: str) -> tuple[dict, Path, list[str]]:
    pieces = tuple(Piece(name=name, f=1.0, i=1.0, w=1.0, activation_bytes=100.0, w_activation_bytes=20.0,
                         param_bytes=10.0, output_bytes=8.0) for name in MODULES)
    result = plan_mesh(CostTable(pieces=pieces, microbatch_size=1), num_ranks=4, global_batch=16,
                       schedules=[schedule], data_parallel=[2], microbatches=[8])
    toml, csv, args = (tmp_path / f"plan.torchtitan.{ext}" for ext in ("toml", "csv", "args"))
    settings = write_torchtitan(result.plan, result.schedule, toml, csv, modules=MODULES, args_path=args)
    lines = args.read_text().splitlines()
    return settings, toml, shlex.split(lines[1])


def _matches(config: object, settings: dict) -> list[str]:
    """The settings whose value in torchtitan's parsed ``config`` differs from the exported one."""
    return [f"{section}.{key}: {getattr(getattr(config, section), key)!r} != {value!r}"
            for section, values in settings.items() for key, value in values.items()
            if getattr(getattr(config, section), key) != value]


@pytest.mark.skipif(not VERSION.startswith("0.2."), reason=f"torchtitan {VERSION}: the 0.2.x parser")
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zbv"])
def test_torchtitan_02_reads_the_toml_and_the_overrides(tmp_path, schedule):
    from torchtitan.config.manager import ConfigManager

    settings, toml, overrides = _export(tmp_path, schedule)
    assert Path(settings["parallelism"]["pipeline_parallel_schedule_csv"]).is_absolute()
    for args in (["--job.config_file", str(toml)], overrides, ["--job.config_file", str(toml), *overrides]):
        config = ConfigManager().parse_args(args)
        assert not _matches(config, settings), (args, _matches(config, settings))
    with pytest.raises(SystemExit):  # why 0.3.x's extra has a line of its own
        ConfigManager().parse_args([*overrides, *torchtitan_overrides(TORCHTITAN_03_SETTINGS)])


@pytest.mark.skipif(not VERSION.startswith("0.3."), reason=f"torchtitan {VERSION}: the 0.3.x parser")
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zbv"])
def test_torchtitan_03_parses_the_overrides(tmp_path, schedule):
    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager.register_tyro_rules(custom_registry)
    settings, _, overrides = _export(tmp_path, schedule)
    extra = torchtitan_overrides(TORCHTITAN_03_SETTINGS)
    try:
        from torchtitan.trainer import Trainer
    except ImportError:  # its data and model dependencies are missing: parse into its sections only
        from torchtitan.config.configs import ParallelismConfig, TrainingConfig

        sections = dataclasses.make_dataclass("Sections", [  # Trainer.Config's two sections, under its names
            ("training", TrainingConfig, dataclasses.field(default_factory=TrainingConfig)),
            ("parallelism", ParallelismConfig, dataclasses.field(default_factory=ParallelismConfig))])
        config = tyro.cli(sections, args=[*overrides, *extra], default=sections(), registry=custom_registry)
        assert config.training.disable_cuda_graphs
    else:
        with pytest.raises(ValueError, match="CUDA graphs do not support pipeline parallelism"):
            tyro.cli(Trainer.Config, args=overrides, registry=custom_registry)
        config = tyro.cli(Trainer.Config, args=[*overrides, *extra], registry=custom_registry)
    assert not _matches(config, settings), _matches(config, settings)


@pytest.mark.parametrize("recompute", ["none", "full", "op"])
def test_the_activation_checkpointing_reaches_torchtitan(tmp_path, recompute):
    """The export's recomputation as torchtitan reads it: 0.2.x's ``activation_checkpoint`` section (TOML and its
    own overrides), 0.3.x's subcommand after its other overrides (``none``, ``FullAC``, the op-level
    ``SelectiveAC``)."""
    from pipeloom.plan.export.torchtitan import ACTIVATION_CHECKPOINTS, version_overrides

    pieces = tuple(Piece(name=name, f=1.0, i=1.0, w=1.0, activation_bytes=100.0, w_activation_bytes=20.0,
                         param_bytes=10.0, output_bytes=8.0) for name in MODULES)
    result = plan_mesh(CostTable(pieces=pieces, microbatch_size=1), num_ranks=4, global_batch=16,
                       schedules=["1f1b"], data_parallel=[2], microbatches=[8])
    toml, csv = tmp_path / "plan.torchtitan.toml", tmp_path / "plan.torchtitan.csv"
    settings = write_torchtitan(result.plan, result.schedule, toml, csv, modules=MODULES,
                                activation_checkpoint=recompute)
    shared, older, newer = version_overrides(settings)
    if VERSION.startswith("0.2."):
        from torchtitan.config.manager import ConfigManager

        for args in (["--job.config_file", str(toml)], [*shared, *older]):
            config = ConfigManager().parse_args(args)
            section = config.activation_checkpoint
            assert {key: getattr(section, key) for key in ACTIVATION_CHECKPOINTS[recompute]} == \
                ACTIVATION_CHECKPOINTS[recompute], args
        return
    from torchtitan.config.configs import ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import ConfigManager, custom_registry
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, FullAC, SelectiveAC

    ConfigManager.register_tyro_rules(custom_registry)
    sections = dataclasses.make_dataclass("Sections", [  # three of Trainer.Config's sections, under its names
        ("training", TrainingConfig, dataclasses.field(default_factory=TrainingConfig)),
        ("parallelism", ParallelismConfig, dataclasses.field(default_factory=ParallelismConfig)),
        ("activation_checkpoint", ActivationCheckpointingConfig,
         dataclasses.field(default_factory=SelectiveAC.Config))])
    config = tyro.cli(sections, args=[*shared, *newer], default=sections(), registry=custom_registry)
    expected = {"none": type(None), "full": FullAC.Config, "op": SelectiveAC.Config}[recompute]
    assert type(config.activation_checkpoint) is expected and config.training.disable_cuda_graphs
    assert not _matches(config, {k: v for k, v in settings.items() if k != "activation_checkpoint"})


def test_context_parallelism_reaches_torchtitan(tmp_path):
    """A plan's context parallelism as torchtitan reads it (``parallelism.context_parallel_degree``), the data
    parallelism and batch per context-parallel group as before, in 0.2.x's parser or 0.3.x's."""
    pieces = tuple(Piece(name=name, f=1.0, i=1.0, w=1.0, activation_bytes=100.0, w_activation_bytes=20.0,
                         param_bytes=10.0, output_bytes=8.0) for name in MODULES)
    result = plan_mesh(CostTable(pieces=pieces, microbatch_size=1), num_ranks=4, global_batch=16,
                       schedules=["1f1b"], data_parallel=[2], microbatches=[8])
    toml, csv, args = (tmp_path / f"plan.torchtitan.{ext}" for ext in ("toml", "csv", "args"))
    plan = dataclasses.replace(result.plan, context_parallel=2)
    settings = write_torchtitan(plan, result.schedule, toml, csv, modules=MODULES, args_path=args)
    assert settings["parallelism"]["context_parallel_degree"] == 2
    overrides = shlex.split(args.read_text().splitlines()[1])
    if VERSION.startswith("0.2."):
        from torchtitan.config.manager import ConfigManager

        config = ConfigManager().parse_args(overrides)
    else:
        from torchtitan.config.configs import ParallelismConfig, TrainingConfig
        from torchtitan.config.manager import ConfigManager, custom_registry

        ConfigManager.register_tyro_rules(custom_registry)
        sections = dataclasses.make_dataclass("Sections", [
            ("training", TrainingConfig, dataclasses.field(default_factory=TrainingConfig)),
            ("parallelism", ParallelismConfig, dataclasses.field(default_factory=ParallelismConfig))])
        config = tyro.cli(sections, args=[*overrides, *torchtitan_overrides(TORCHTITAN_03_SETTINGS)],
                          default=sections(), registry=custom_registry)
    assert not _matches(config, settings), _matches(config, settings)


def test_the_sequence_compile_and_async_tp_reach_torchtitan(tmp_path):
    """A cluster plan's sequence length (``training.seq_len``), fused kernels (``compile.enable``) and async tensor
    parallelism as torchtitan reads them: 0.2.x's parser (TOML; overrides with its own line, where async TP is
    ``parallelism.enable_async_tensor_parallel``) or 0.3.x's (its sections, async TP under ``compile``)."""
    from pipeloom.plan.export.torchtitan import version_overrides

    pieces = tuple(Piece(name=name, f=1.0, i=1.0, w=1.0, activation_bytes=100.0, w_activation_bytes=20.0,
                         param_bytes=10.0, output_bytes=8.0) for name in MODULES)
    result = plan_mesh(CostTable(pieces=pieces, microbatch_size=1), num_ranks=4, global_batch=16,
                       schedules=["1f1b"], data_parallel=[2], microbatches=[8])
    plan = dataclasses.replace(result.plan, sequence_length=8192)
    toml, csv, args = (tmp_path / f"plan.torchtitan.{ext}" for ext in ("toml", "csv", "args"))
    settings = write_torchtitan(plan, result.schedule, toml, csv, modules=MODULES, args_path=args, compiled=True,
                                async_tp=True)
    assert settings["training"]["seq_len"] == 8192 and settings["compile"] == {"enable": True}
    assert settings["parallelism"]["enable_async_tensor_parallel"] is True
    shared, older, newer = version_overrides(settings)
    assert "--parallelism.enable_async_tensor_parallel" in older and "--compile.enable_async_tensor_parallel" in newer
    assert not any("enable_async" in word for word in shared)
    if VERSION.startswith("0.2."):
        from torchtitan.config.manager import ConfigManager

        for given in (["--job.config_file", str(toml)], [*shared, *older]):
            config = ConfigManager().parse_args(given)
            assert not _matches(config, settings), (given, _matches(config, settings))
        return
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager.register_tyro_rules(custom_registry)
    sections = dataclasses.make_dataclass("Sections", [
        ("training", TrainingConfig, dataclasses.field(default_factory=TrainingConfig)),
        ("parallelism", ParallelismConfig, dataclasses.field(default_factory=ParallelismConfig)),
        ("compile", CompileConfig, dataclasses.field(default_factory=CompileConfig))])
    config = tyro.cli(sections, args=[*shared, *newer], default=sections(), registry=custom_registry)
    assert config.compile.enable_async_tensor_parallel
    in_03 = {section: {k: v for k, v in values.items() if k != "enable_async_tensor_parallel"}
             for section, values in settings.items()}
    assert not _matches(config, in_03), _matches(config, in_03)


def test_async_tp_is_not_exported_without_compile(tmp_path):
    pieces = tuple(Piece(name=name, f=1.0, i=1.0, w=1.0, activation_bytes=100.0, w_activation_bytes=20.0,
                         param_bytes=10.0, output_bytes=8.0) for name in MODULES)
    result = plan_mesh(CostTable(pieces=pieces, microbatch_size=1), num_ranks=4, global_batch=16,
                       schedules=["1f1b"], data_parallel=[2], microbatches=[8])
    with pytest.raises(PlanError, match="async tensor parallelism runs only under torch.compile"):
        write_torchtitan(result.plan, result.schedule, tmp_path / "a.toml", tmp_path / "a.csv", modules=MODULES,
                         async_tp=True)
