"""Run config: strict loading with dotted-path errors, overrides through the same checks, schema in step."""

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
        ({"parallel": {"compile": True, "cpu_offload": True}}, "parallel.compile: not supported together"),
        ({"preflight": {"sizes_mib": []}}, "preflight.sizes_mib: expected a non-empty list"),
        ({"preflight": {"expect": {"transport": "carrier-pigeon"}}}, "preflight.expect.transport: expected"),
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
