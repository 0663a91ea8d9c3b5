"""Config validation: bad input raises a ConfigError (a ValueError) that says what to fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ddptrain as train
from ddptrain.errors import ConfigError
from ddptrain.torch import TorchConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": -1}, "`num_workers` must be >= 0, got -1"),
        ({"num_workers": 2.5}, "`num_workers` must be an integer"),
        ({"num_workers": (4, 2)}, "needs min_workers <= max_workers, got (4, 2)"),
        ({"num_workers": (0, 2)}, "(min_workers)` must be >= 1, got 0."),
        ({"num_workers": (1, 2, 3)}, "must be (min_workers, max_workers), got (1, 2, 3)"),
        ({"num_workers": (1, 2), "elastic_resize_monitor_interval_s": 0}, "must be a number of seconds > 0, got 0"),
        ({"use_gpu": "yes"}, "`use_gpu` must be True or False"),
        ({"resources_per_worker": {"GPU": 1}}, "`use_gpu` is False"),
        ({"use_gpu": True, "resources_per_worker": {"GPU": 0}}, "at least part of a GPU"),
        ({"resources_per_worker": {"CPU": -1}}, "must be a number >= 0"),
        ({"use_gpu": True, "resources_per_worker": {"gpu": 1}}, "has 'gpu': did you mean 'GPU'?"),
        ({"resources_per_worker": {"CPUS": 2}}, "has 'CPUS': did you mean 'CPU'?"),
        ({"placement_strategy": "RANDOM"}, "`placement_strategy` must be one of"),
        ({"trainer_resources": {"CPU": 1}}, None),
    ],
)
def test_scaling_config_rejects_bad_input(kwargs: dict, message: str | None) -> None:
    if message is None:
        with pytest.raises(DeprecationWarning):
            train.ScalingConfig(**kwargs)
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        train.ScalingConfig(**kwargs)
    assert isinstance(info.value, train.ConfigError)


def test_scaling_config_resources() -> None:
    # As Ray's: each worker's non-zero resources times num_workers.
    assert train.ScalingConfig(num_workers=2).total_resources == {"CPU": 2}
    assert train.ScalingConfig(num_workers=2, use_gpu=True).total_resources == {"GPU": 2}
    assert train.ScalingConfig(
        num_workers=3, use_gpu=True, resources_per_worker={"CPU": 0, "GPU": 1, "memory": 0}
    ).total_resources == {"GPU": 3}
    assert train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2, "GPU": 0}).total_resources == {"CPU": 4}
    gpu = train.ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"GPU": 2})
    assert gpu.num_gpus_per_worker == 2
    assert train.ScalingConfig(resources_per_worker={"CPU": 3})._omp_num_threads() == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": ""}, "`name` must be a non-empty string"),
        ({"name": "a/b"}, "plain folder name"),
        ({"name": "a\0b"}, "must not hold control characters"),  # it was "embedded null byte" at fit()
        ({"name": "epoch\n3"}, "must not hold control characters"),  # it made a folder 'epoch\n3'
        ({"name": "x" * 256}, "`name` is 256 bytes long, but a folder name holds at most 255"),  # ENAMETOOLONG
        ({"storage_filesystem": object()}, "must be an fsspec or a pyarrow.fs file system"),
        ({"storage_path": 3}, "`storage_path` must be a path"),
        ({"failure_config": {"max_failures": 1}}, "must be a ddptrain.FailureConfig"),
        ({"callbacks": [object()]}, "UserCallback"),
        ({"worker_runtime_env": {"pip": ["x"]}}, "supports only 'env_vars'"),
        ({"worker_runtime_env": ["A=1"]}, "`worker_runtime_env` must be a dict such as"),
        ({"callbacks": train.UserCallback()}, "`callbacks` must be a list.*Pass a list: `callbacks=\\[callback\\]`"),
    ],
)
def test_run_config_rejects_bad_input(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train.RunConfig(**kwargs)


def test_run_config_deprecated_fields_raise_like_ray() -> None:
    with pytest.raises(DeprecationWarning):
        train.RunConfig(verbose=1)
    with pytest.raises(DeprecationWarning):
        train.CheckpointConfig(checkpoint_frequency=1)


def test_run_config_storage_path_expands_home_and_accepts_path(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert train.RunConfig(storage_path="~/runs")._storage_root() == tmp_path / "runs"
    assert train.RunConfig(storage_path=tmp_path / "x")._storage_root() == tmp_path / "x"
    monkeypatch.delenv("DDPTRAIN_STORAGE_PATH", raising=False)
    assert train.RunConfig()._storage_root() == tmp_path / "ddptrain_results"


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (train.CheckpointConfig, {"num_to_keep": 0}, "`num_to_keep` must be >= 1"),
        (train.CheckpointConfig, {"checkpoint_score_order": "best"}, "'max' or 'min'"),
        (train.CheckpointConfig, {"checkpoint_score_attribute": ""}, "must be a metric name \\(str\\), got ''"),
        (train.FailureConfig, {"max_failures": -2}, "`max_failures` must be >= -1"),
        (train.LoggingConfig, {"log_level": "LOUD"}, "logging level name"),
        (TorchConfig, {"init_method": "file"}, "'env' or 'tcp'"),
        (TorchConfig, {"timeout_s": 0}, "`timeout_s` must be"),
    ],
)
def test_other_configs_reject_bad_input(cls: type, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_datasets_to_split_of_the_wrong_type_is_a_type_error_like_rays() -> None:
    for bad in ("hello", 3, None, ["train", 1]):
        with pytest.raises(TypeError, match="`datasets_to_split` must be 'all' or a list of dataset names"):
            train.DataConfig(datasets_to_split=bad)  # type: ignore[arg-type]
    assert train.DataConfig(datasets_to_split=["train"]).datasets_to_split == ["train"]


def test_trainer_rejects_wrong_config_types() -> None:
    def fn() -> None:
        pass

    with pytest.raises(ValueError, match="`scaling_config` must be a ddptrain.ScalingConfig"):
        train.DataParallelTrainer(fn, scaling_config={"num_workers": 2})
    with pytest.raises(ValueError, match="not its result"):
        train.DataParallelTrainer(fn())  # type: ignore[func-returns-value]
    with pytest.raises(ValueError, match="requires 2: a, b"):
        train.DataParallelTrainer(lambda a, b: None)
    with pytest.raises(ValueError, match="`train_loop_config` must be a dict"):
        train.DataParallelTrainer(fn, train_loop_config=[1])
    with pytest.raises(ValueError, match=r"`datasets` must be a dict of named datasets, .*got list"):
        train.DataParallelTrainer(fn, datasets=[train.data.from_items([{"x": 1}])])  # type: ignore[arg-type]


def test_a_generator_or_async_training_function_is_refused() -> None:
    """Calling either runs none of its body: before, fit() "finished" without training."""

    def steps(config):
        yield 1

    async def loop(config):
        return 1

    with pytest.raises(ValueError, match="`steps` is a generator function .* `ddptrain.report"):
        train.DataParallelTrainer(steps)
    with pytest.raises(ValueError, match=r"`loop` is an `async def` function.*asyncio.run\(loop\(config\)\)"):
        train.DataParallelTrainer(loop)


def test_custom_resources_are_accepted_and_ignored_as_in_ray() -> None:
    config = train.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1, "memory": 2**30, "special": 1})
    assert config.num_cpus_per_worker == 1


def test_config_changed_after_creation_is_checked_at_fit(storage: str) -> None:
    scaling = train.ScalingConfig(num_workers=1)
    trainer = train.DataParallelTrainer(lambda: None, scaling_config=scaling)
    scaling.num_workers = -3
    with pytest.raises(ValueError, match="got -3"):
        trainer.fit()


def test_remote_storage_paths_are_checked_before_anything_starts(tmp_path: Path) -> None:
    from ddptrain.errors import ConfigError

    assert train.RunConfig(storage_path=f"file://{tmp_path}")._remote() is None  # a local path
    assert train.RunConfig(storage_path=f"file://{tmp_path}")._storage_root() == tmp_path
    with pytest.raises(ConfigError, match="memory:// file system cannot hold a run"):
        train.RunConfig(storage_path="memory://bucket/x")._remote()
    with pytest.raises(ConfigError, match="fsspec knows no file system for nosuchscheme://"):
        train.RunConfig(storage_path="nosuchscheme://bucket/x")._remote()
    with pytest.raises(ConfigError, match="must be an fsspec or a pyarrow.fs file system"):
        train.RunConfig(storage_path="bucket/x", storage_filesystem=object())._remote()
    fsspec = pytest.importorskip("fsspec")
    with pytest.raises(ConfigError, match="not a URI"):
        train.RunConfig(storage_path="s3://bucket/x", storage_filesystem=fsspec.filesystem("memory"))._remote()


def test_storage_filesystem_without_storage_path_uses_the_default_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As Ray: the path on the file system defaults to the default storage path."""
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    monkeypatch.delenv("DDPTRAIN_STORAGE_PATH", raising=False)
    fs = DirFileSystem(path=str(tmp_path), fs=LocalFileSystem())
    config = train.RunConfig(name="run", storage_filesystem=fs)
    root = config._remote()
    assert root is not None and root.root == os.path.expanduser("~/ddptrain_results")
    config._check_storage()  # the folders are created on the file system
    assert (tmp_path / os.path.expanduser("~/ddptrain_results").lstrip("/")).is_dir()
    monkeypatch.setenv("DDPTRAIN_STORAGE_PATH", "/shared/runs")
    assert train.RunConfig(storage_filesystem=fs)._remote().root == "/shared/runs"
    monkeypatch.setenv("DDPTRAIN_STORAGE_PATH", "s3://bucket/runs")
    with pytest.raises(
        ConfigError, match="not a URI: got 's3://bucket/runs' \\(the default, from DDPTRAIN_STORAGE_PATH\\)"
    ):
        train.RunConfig(storage_filesystem=fs)._remote()


def test_pyarrow_uri_options_are_understood_or_refused_with_what_to_do() -> None:
    """``s3://bucket?region=...&endpoint_override=...`` (what Ray's tests pass) configures the
    client; options ddptrain cannot map, and credentials in the URI, are refused."""
    pytest.importorskip("s3fs")
    root = train.RunConfig(
        storage_path="s3://bucket/prefix?region=eu-west-3&endpoint_override=localhost:9000&scheme=http"
    )._remote()
    assert root is not None and root.root == "bucket/prefix"
    assert root.fs.client_kwargs["region_name"] == "eu-west-3"
    assert root.fs.endpoint_url == "http://localhost:9000"
    assert root.display() == "bucket/prefix"  # paths go with `.filesystem`, as in Ray
    with pytest.raises(ConfigError, match="'tls_ca_file_path' are not understood.*storage_filesystem=fs"):
        train.RunConfig(storage_path="s3://bucket/prefix?tls_ca_file_path=/ca.pem")._remote()
    with pytest.raises(ConfigError, match="credentials in the URI are refused") as info:
        train.RunConfig(storage_path="s3://AKIAKEY:topsecret@bucket/prefix")._remote()
    assert "topsecret" not in str(info.value)
    plain = train.RunConfig(storage_path="s3://bucket/prefix")._remote()
    assert plain.display() == "s3://bucket/prefix" and plain.root == "bucket/prefix"


def test_an_elastic_scaling_config_has_rays_bounds() -> None:
    config = train.ScalingConfig(num_workers=(2, 6))
    assert config.elastic and (config.min_workers, config.max_workers) == (2, 6)
    assert config.total_resources == {"CPU": 6.0}  # the upper bound, from max_workers (as Ray)
    fixed = train.ScalingConfig(num_workers=3)
    assert not fixed.elastic and (fixed.min_workers, fixed.max_workers) == (3, 3)
