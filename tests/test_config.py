"""Run config: strict loading with dotted-path errors, overrides through the same checks, schema in step."""

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from job import config as config_lib
from job.config import ConfigError

VALID = {"name": "r", "model": {"preset": "qwen2-tiny", "init": "random"}}


def load_with(**sections):
    raw = yaml.safe_load(yaml.safe_dump(VALID))
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return config_lib.load_dict(raw)


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"train": {"seq_len": "abc"}}, "train.seq_len: expected int, got 'abc'"),
        ({"train": {"max_steps": 1.5}}, "train.max_steps: expected int, got 1.5"),
        ({"train": {"lr": True}}, "train.lr: expected float, got True"),
        ({"scaling": {"use_gpu": "yes"}}, "scaling.use_gpu: expected bool, got 'yes'"),
        ({"trian": {}}, "trian: unknown key"),
        ({"model": {"preset": "qwen2-tiny", "init": "random", "layers": 2}}, "model.layers: unknown key"),
        ({"parallel": {"mixed_precision": "fp16"}}, "parallel.mixed_precision: expected 'auto' | 'bf16' | 'fp32'"),
        ({"train": {"betas": [0.9, "x"]}}, "train.betas[1]: expected float"),
        ({"train": "fast"}, "train: expected a mapping"),
        ({"train": {"micro_batch_size": 0}}, "train.micro_batch_size: must be > 0"),
        ({"train": {"warmup_steps": 100, "max_steps": 50}}, "train.warmup_steps: 100 must be below train.max_steps"),
        ({"name": ""}, "name: required"),
        ({"model": {"init": "pretrained", "preset": None}}, "model.path: required with model.init: pretrained"),
        ({"model": {"preset": None, "init": "random"}}, "model.preset: model.init: random needs an architecture"),
        ({"data": {"format": "text"}}, "data.train: required with data.format: text"),
        ({"data": {"format": "synthetic", "train": "x.txt"}}, "data.train: synthetic data takes no source"),
        ({"parallel": {"mixed_precision": "bf16"}}, "parallel.mixed_precision: bf16 needs scaling.use_gpu"),
        ({"parallel": {"float8": "rowwise"}}, "parallel.float8: rowwise needs scaling.use_gpu: true"),
        ({"parallel": {"float8": "fp8"}}, "parallel.float8: expected 'none' | 'rowwise' | 'tensorwise'"),
        ({"parallel": {"float8": "tensorwise", "mixed_precision": "fp32"}, "scaling": {"use_gpu": True}},
         "parallel.float8: tensorwise needs bf16 compute"),
        ({"parallel": {"compile": True, "cpu_offload": True}}, "parallel.compile: not supported together"),
        ({"preflight": {"sizes_mib": []}}, "preflight.sizes_mib: expected a non-empty list"),
        ({"preflight": {"expect": {"transport": "carrier-pigeon"}}}, "preflight.expect.transport: expected"),
        ({"train": {"hang_timeout_s": -1}}, "train.hang_timeout_s: must be >= 0 (0: off; null: automatic)"),
        ({"train": {"loss_spike_factor": 0.5}}, "train.loss_spike_factor: must be 0 (off) or > 1, got 0.5"),
        ({"train": {"loss_spike_intervals": 0}}, "train.loss_spike_intervals: must be > 0"),
        ({"train": {"hang_timeout_s": 0}, "debug": {"fail_at_step": 3, "fail_mode": "hang"}},
         "debug.fail_mode: hang needs its check on: train.hang_timeout_s is 0"),
        ({"model": {"lora": {"rank": 0}}}, "model.lora.rank: must be > 0 (null: full fine-tune), got 0"),
        ({"model": {"lora": {"rank": 8, "dropout": 1}}}, "model.lora.dropout: must be within [0, 1)"),
        ({"model": {"lora": {"rank": 8, "targets": []}}}, "model.lora.targets: expected a non-empty list"),
        ({"model": {"lora": {"rank": 8}}, "parallel": {"float8": "rowwise"}, "scaling": {"use_gpu": True}},
         "model.lora.rank: LoRA does not run with parallel.float8: rowwise"),
        ({"model": {"lora": {"merged_export": True}}}, "model.lora.merged_export: merges adapters, and model.lora.rank is null"),
    ],
)
def test_bad_input_names_the_field(sections, message):
    with pytest.raises(ConfigError) as info:
        load_with(**sections)
    assert message in str(info.value)


def test_overrides_use_the_same_validation(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(VALID))
    cfg = config_lib.load(str(path), ["train.max_steps=20", "train.lr=5e-3", "model.overrides.num_hidden_layers=2"])
    assert cfg.train.max_steps == 20 and cfg.train.lr == 0.005
    assert cfg.model.overrides == {"num_hidden_layers": 2}
    with pytest.raises(ConfigError, match=r"^train.seq_len: expected int, got 'abc'$"):
        config_lib.load(str(path), ["train.seq_len=abc"])
    with pytest.raises(ConfigError, match="train.nope: unknown key"):
        config_lib.load(str(path), ["train.nope=1"])
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        config_lib.load(str(path), ["train.max_steps"])


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        config_lib.load(str(tmp_path / "absent.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config_lib.load(str(bad))


def test_round_trip_and_defaults():
    cfg = load_with(train={"seq_len": 128})
    again = config_lib.load_dict(yaml.safe_load(config_lib.to_yaml(cfg)))
    assert again == cfg and again.train.seq_len == 128


def test_json_schema_agrees_with_the_loader():
    schema = config_lib.json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    good = config_lib.to_dict(load_with())
    assert not list(validator.iter_errors(good))
    for bad in ({**good, "trian": {}}, {**good, "train": {**good["train"], "seq_len": "abc"}},
                {**good, "parallel": {**good["parallel"], "mixed_precision": "fp16"}}):
        assert list(validator.iter_errors(bad))
    # Every field is documented: the descriptions become the chart's value documentation.
    def walk(node, path):
        for key, sub in node.get("properties", {}).items():
            assert sub.get("description"), f"{path}{key} has no description"
            walk(sub, f"{path}{key}.")
    walk(schema, "")


def test_every_problem_is_reported_at_once_in_file_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "name": "a/../../b",  # would escape storage_path
        "model": {"preset": "qwen2-tiny", "init": "random", "train_tokenizer_vocab": 512},
        "data": {"format": "text", "train": "builtin:python-docs", "validation_fraction": 0},
        "eval": {"every_steps": 5},
        "train": {"max_steps": 10, "warmup_steps": 2},
        "checkpoint": {"every_steps": 50},
    }, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        config_lib.load(str(path), ["train.micro_batch_size=2"])
    fields = [m.split(":")[0] for m in info.value.messages]
    # checkpoint.export is left at its default: it sorts where its section starts.
    assert fields == ["name", "eval.every_steps", "checkpoint.export", "checkpoint.every_steps"]
    assert str(info.value).count("\n") == 3
    # Type errors are collected the same way (before the cross-field checks, which need a typed config).
    with pytest.raises(ConfigError) as info:
        load_with(train={"seq_len": "abc", "lr": "fast"}, scaling={"use_gpu": "yes"})
    assert [m.split(":")[0] for m in info.value.messages] == ["train.seq_len", "train.lr", "scaling.use_gpu"]


@pytest.mark.parametrize("name", ["a/../../b", "../up", "/abs", ".hidden", "a/b", "with space"])
def test_run_name_cannot_leave_storage_path(name):
    with pytest.raises(ConfigError, match="^name: .* must be one directory name"):
        load_with(name=name)


def test_resume_changes_are_opt_in_by_name():
    assert load_with().checkpoint.allow_changes == []
    assert load_with(checkpoint={"allow_changes": ["seed", "data"]}).checkpoint.allow_changes == ["seed", "data"]
    with pytest.raises(ConfigError, match=r"checkpoint.allow_changes\[0\]: expected 'tokenizer' \| 'data'"):
        load_with(checkpoint={"allow_changes": ["model"]})


def test_driver_reports_every_problem_before_any_worker(tmp_path, capsys):
    """`python -m job` exits 2 listing each problem of the storage and the model, one line each."""
    from job.__main__ import main

    blocker = tmp_path / "file"
    blocker.write_text("")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**VALID, "storage_path": str(blocker),
                                    "model": {**VALID["model"], "overrides": {"num_attention_heads": 5}},
                                    "train": {"seq_len": 9000}}))
    assert main(["--config", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["storage_path", "model.overrides", "model.overrides",
                                                               "train.seq_len"]
    assert f"cannot create and write the run directory {blocker}/r (NotADirectoryError" in lines[0]
    assert lines[1].endswith("hidden_size 128 is not divisible by num_attention_heads 5")
    assert lines[3].endswith("train.seq_len: 9000 is beyond the model's max_position_embeddings (4096)")


def test_a_model_directory_is_checked_against_its_config_json_with_the_overrides(tmp_path):
    from job.driver import launch

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 96, "num_attention_heads": 6,
                                                   "num_key_value_heads": 2, "max_position_embeddings": 512}))
    pretrained = {"init": "pretrained", "preset": None, "path": str(model)}
    assert launch._model_problems(load_with(model=pretrained, train={"seq_len": 512})) == []
    problems = launch._model_problems(load_with(model={**pretrained, "overrides": {"num_key_value_heads": 4}},
                                                train={"seq_len": 513}))
    assert problems == ["model.overrides: num_attention_heads 6 is not divisible by num_key_value_heads 4",
                        "train.seq_len: 513 is beyond the model's max_position_embeddings (512)"]
    (model / "config.json").unlink()
    (problem,) = launch._model_problems(load_with(model=pretrained))
    assert problem.startswith("model.path: cannot read the model's config (FileNotFoundError") and str(model) in problem
    (problem,) = launch._model_problems(load_with(model={**pretrained, "path": str(tmp_path / "absent")}))
    assert problem == f"model.path: cannot read the model's config (FileNotFoundError: {tmp_path / 'absent'} is not a directory)"


def test_the_driver_does_not_import_the_training_loop(tmp_path):
    """The driver only checks and launches the loop: the model, FSDP2 and compiler imports are the workers'
    (they took ~6 of the driver's ~14 s on the H200 machine), and the checks of the model's settings read its
    config without Transformers (~7 s more, run 24)."""
    import subprocess
    import sys

    blocker = tmp_path / "file"
    blocker.write_text("")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**VALID, "storage_path": str(blocker), "train": {"seq_len": 9000}}))
    probe = (f"import sys; from job.__main__ import main; assert main(['--config', {str(path)!r}]) == 2; "
             "print(sorted(m for m in ('job.worker.train', 'job.worker.model', 'torch._inductor', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, check=True)
    assert "train.seq_len: 9000 is beyond" in out.stderr  # the model's settings were checked
    assert out.stdout.strip() == "[]"


def test_help_lists_the_commands(capsys):
    from job.__main__ import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("runs STORAGE", "compare RUN_A RUN_B", "report RUN_DIR", "accept EXPORT_DIR", "schema"):
        assert command in out


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_config_loads_and_validates(example):
    assert config_lib.load(str(EXAMPLES / example)).name


def test_a_rules_number_is_written_as_the_chart_writes_it():
    """A float in a rule's message reads as Go's `%v` prints it, so the chart's message is the job's."""
    from job.rules import go_float

    shown = [go_float(x) for x in (1.0, 0.5, 2e-05, 1e6, 123456.0, 1234567.0, -0.25, 0.0001, 1e-05, 0.0)]
    assert shown == ["1", "0.5", "2e-05", "1e+06", "123456", "1.234567e+06", "-0.25", "0.0001", "1e-05", "0"]


def test_a_rule_outside_the_rules_language_is_refused():
    from job import rules

    cfg = config_lib.load_dict(VALID)
    assert rules.Rule("train.seed", "train.seed in (0, 1) and not starts(name, 'x')", "x").broken(cfg)
    with pytest.raises(ValueError, match="not part of the rules' language"):
        rules.Rule("train.betas", "len(train.betas) > 2", "x").broken(cfg)


def test_progress_bar_on_and_off_as_yaml_reads_them():
    """The documented `on`/`off` arrive as booleans from YAML 1.1 (PyYAML, Helm's values): both mean what they say,
    and a wrong value is shown as typed."""
    for text, shown in (("on", "on"), ("off", "off"), ("true", "on"), ("auto", "auto")):
        raw = yaml.safe_load(f"logging: {{progress_bar: {text}}}")
        assert config_lib.load_dict({**VALID, **raw}).logging.progress_bar == shown
    with pytest.raises(config_lib.ConfigError, match=r"^logging.progress_bar: expected 'auto' \| 'on' \| 'off', got 'sometimes'$"):
        config_lib.load_dict({**VALID, "logging": {"progress_bar": "sometimes"}})


def test_no_workers_is_one_error_naming_the_field_set():
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.load_dict({**VALID, "scaling": {"num_workers": 0}})
    assert info.value.messages == ["scaling.num_workers: must be > 0, got 0"]
