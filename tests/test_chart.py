"""The Helm chart at the repository root: lint, render, validate every object, reject bad values, package.

Needs the pinned helm (scripts/install-helm.sh) and ../shared/kuberay-crds/; no Kubernetes API server.
"""

import importlib.util
import inspect
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
import yaml

from chart_helpers import (
    REPO,
    by_kind,
    helm,
    names_field,
    template_args,
    one,
    profile_commands,
    render,
    render_error,
    run_config,
    validate,
)

from job import __version__ as job_version
from job import config as job_config
from job import rules
from job.config import ConfigError, json_schema, load_dict
from job.driver import follow

_spec = importlib.util.spec_from_file_location("gen_values_schema", REPO / "scripts" / "gen-values-schema.py")
GENERATOR = importlib.util.module_from_spec(_spec)
"""scripts/gen-values-schema.py: how the chart words the job's rules (`prefixed`)."""
_spec.loader.exec_module(GENERATOR)

PROFILE_COMMANDS = profile_commands()
# Every combination shown in the profiles' comments, plus the chart's own modes.
COMBINATIONS = {
    "defaults": [],
    **PROFILE_COMMANDS,
    "warm cluster": ["--set", "rayCluster.create=true"],
    "warm cluster with Kueue": ["--set", "rayCluster.create=true", "--set", "kueue.queueName=team-a"],
    "Kueue": ["--set", "kueue.queueName=team-a", "--set", "rayJob.shutdownAfterJobFinishes=true"],
    "s3 storage with credentials": ["--set", "storage.uri=s3://bucket/runs", "--set", "storage.existingSecret=s3-creds"],
    "existing claim, digest, deadlines": [
        "--set", "storage.existingClaim=shared-runs",
        "--set", "image.digest=sha256:" + "a" * 64,
        "--set", "rayJob.activeDeadlineSeconds=86400", "--set", "rayJob.preRunningDeadlineSeconds=1800",
    ],
    "deletion rules": ["-f", "tests/fixtures/deletion-rules.yaml"],
    "HTTPMode": ["--set", "rayJob.submissionMode=HTTPMode"],
    "SidecarMode": ["--set", "rayJob.submissionMode=SidecarMode"],
    "PodMonitor and Grafana dashboard": ["--set", "monitoring.podMonitor.enabled=true",
                                         "--set", "monitoring.grafanaDashboard.enabled=true",
                                         "--set", "monitoring.podMonitor.labels.release=prometheus"],
    "no RayJob reporting": ["--set", "monitoring.rayJob=false"],
    **{f"ci/{p.name}": ["-f", f"ci/{p.name}"] for p in sorted((REPO / "ci").glob("*-values.yaml"))},
}
INVALID_VALUES = sorted((REPO / "tests" / "fixtures" / "invalid-values").glob("*.yaml"))
SCHEMA = json.loads((REPO / "values.schema.json").read_text())


def job_files() -> list:
    """The job package's files, as the chart ships them (its .helmignore leaves out `__pycache__`)."""
    return [p for p in (REPO / "job").rglob("*") if p.suffix in (".py", ".json") and "__pycache__" not in p.parts]


def ray_pod_specs(objects):
    """(group, pod template) of every Ray pod: head and worker groups, of the RayJob or the RayCluster."""
    for obj in objects:
        if obj["kind"] not in ("RayJob", "RayCluster"):
            continue
        spec = obj["spec"].get("rayClusterSpec") if obj["kind"] == "RayJob" else obj["spec"]
        if spec:
            yield "head", spec["headGroupSpec"]
            for group in spec["workerGroupSpecs"]:
                yield group["groupName"], group


def test_profiles_start_with_their_install_command():
    for profile in sorted((REPO / "values").glob("*.yaml")):
        first = profile.read_text().splitlines()[0]
        assert first.startswith("# helm install "), f"{profile.name}: first line must give its install command"
    assert {name.split(":")[0] for name in PROFILE_COMMANDS} == {p.name for p in (REPO / "values").glob("*.yaml")}


@pytest.mark.parametrize("args", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_lint_strict(args):
    helm("lint", "--strict", ".", *args)


@pytest.mark.parametrize("args", COMBINATIONS.values(), ids=COMBINATIONS.keys())
def test_every_rendered_object_is_valid(args):
    objects = render(*args)
    assert {o["kind"] for o in objects} >= {"RayJob", "ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Pod"}
    for obj in objects:
        validate(obj)
    # The rendered run config is one the job accepts.
    load_dict(run_config(objects))


@pytest.mark.parametrize("values_file", INVALID_VALUES, ids=[p.stem for p in INVALID_VALUES])
def test_invalid_values_are_rejected_naming_the_field(values_file):
    header = values_file.read_text().splitlines()[0]
    assert header.startswith("# expect: ") and len(header) > len("# expect: "), "first line: # expect: <message>"
    assert names_field(render_error("-f", str(values_file.relative_to(REPO))), header.removeprefix("# expect: "))


def test_validation_catches_unknown_fields():
    rayjob = one(render(), "RayJob")
    rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(AssertionError, match="bogus"):
        validate(rayjob)


# ---------------------------------------------------------------------------------------------------------------------
# values.schema.json and values.yaml in step with each other and with the job's config schema
# ---------------------------------------------------------------------------------------------------------------------


def test_run_schema_is_generated_from_the_job_config():
    assert SCHEMA["properties"]["run"] == json_schema(), "run scripts/gen-values-schema.py"
    subprocess.run([sys.executable, "scripts/gen-values-schema.py", "--check"], cwd=REPO, check=True)


def test_schema_is_strict_throughout():
    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                assert node.get("additionalProperties") is False, f"{path}: additionalProperties must be false"
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(SCHEMA, "")


def test_values_yaml_matches_the_schema():
    values = yaml.safe_load((REPO / "values.yaml").read_text())
    jsonschema.Draft7Validator(SCHEMA).validate(values)

    # Every key of values.yaml is described in the schema (not only allowed), and every chart value the schema
    # describes has a default in values.yaml.
    def compare(value, schema, path):
        if not (isinstance(value, dict) and "properties" in schema):
            return
        assert set(value) <= set(schema["properties"]), f"{path}: not in the schema: {set(value) - set(schema['properties'])}"
        for key, sub in value.items():
            compare(sub, schema["properties"][key], f"{path}.{key}")

    compare(values, SCHEMA, "values")
    chart_keys = set(SCHEMA["properties"]) - {"raylib", "global"}
    assert chart_keys == set(values), f"schema and values.yaml differ: {chart_keys ^ set(values)}"


def test_every_value_is_documented():
    """helm-docs style: every value has a `# --` comment; a parent of documented keys needs none, and the
    contents of a documented value (e.g. efa.env's variables) are part of it. run: is documented by its schema."""
    lines = (REPO / "values.yaml").read_text().splitlines()
    documented_ancestors = []  # (indent, documented) of the keys enclosing the current line
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w-]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while documented_ancestors and documented_ancestors[-1][0] >= indent:
            documented_ancestors.pop()
        comments = []
        for above in reversed(lines[:i]):
            if not above.strip().startswith("#"):
                break
            comments.append(above.strip())
        documented = any(c.startswith("# --") for c in comments) or match.group(2) == "run"
        following = next((l for l in lines[i + 1 :] if l.strip() and not l.strip().startswith("#")), "")
        is_parent = re.match(r"^\s*[A-Za-z][\w-]*:", following) and len(following) - len(following.lstrip()) > indent
        inside_documented = any(d for _, d in documented_ancestors)
        assert documented or inside_documented or is_parent, f"values.yaml:{i + 1} {line.strip()}: no '# --' comment"
        documented_ancestors.append((indent, documented or inside_documented))


def test_default_run_config_loads_in_the_job():
    values = yaml.safe_load((REPO / "values.yaml").read_text())
    load_dict({**values["run"], "name": "check"})
    assert load_dict(run_config(render())).name == "exp1"


def test_runtime_env_pins_match_requirements():
    """The stock-image profile installs the job's dependencies as pinned for CI; the default image needs none."""
    pins = {l.split("==")[0]: l for l in (REPO / "requirements.txt").read_text().splitlines() if "==" in l}
    profile = yaml.safe_load((REPO / "values" / "cpu-smoke.yaml").read_text())
    for requirement in profile["runtimeEnv"]["pip"]:
        assert pins[requirement.split("==")[0]] == requirement
    assert "runtimeEnvYAML" not in one(render(), "RayJob")["spec"]


def test_mlflow_adds_its_client_to_the_runtime_env_only_when_configured():
    """The image has no mlflow: `run.logging.mlflow.tracking_uri` adds the job's pin to the pip list (either form),
    once; the run record lists what the runtime env installed."""
    from job.packages import MLFLOW_VERSION

    uri = ["--set", "run.logging.mlflow.tracking_uri=http://mlflow:5000"]

    def pip(*args):
        return yaml.safe_load(one(render(*args), "RayJob")["spec"]["runtimeEnvYAML"])["pip"]

    assert pip(*uri) == [f"mlflow-skinny=={MLFLOW_VERSION}"]
    assert pip(*uri, "--set", "runtimeEnv.pip.packages={s3fs==2026.4.0}") == \
        {"packages": ["s3fs==2026.4.0", f"mlflow-skinny=={MLFLOW_VERSION}"]}
    assert pip(*uri, "--set", "runtimeEnv.pip={mlflow==3.1.0}") == ["mlflow==3.1.0"]
    assert "runtimeEnvYAML" not in one(render("--set", "run.logging.mlflow.experiment=x"), "RayJob")["spec"]


# ---------------------------------------------------------------------------------------------------------------------
# The chart rejects at `helm install` what the job rejects at start
# ---------------------------------------------------------------------------------------------------------------------

DEFAULT_RUN = yaml.safe_load((REPO / "values.yaml").read_text())["run"]
GPU_CLUSTER = ({}, {"num_workers": 1, "use_gpu": True, "cpus_per_worker": 8})  # values.yaml's one 1-GPU worker
CPU_CLUSTER = ({"worker": {"gpus": 0, "replicas": 2}}, {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 8})
REAL_DATA = {
    "model": {"init": "pretrained", "preset": None, "path": "Qwen/Qwen2.5-1.5B"},
    "data": {"format": "prompt_completion", "train": "/mnt/runs/gsm8k/train.jsonl",
             "columns": {"prompt": "question", "completion": "answer"}, "prompt_template": "Q: {prompt}\nA: "},
    "eval": {"task": "gsm8k"},
}


def helm_merged(base: dict, override: dict) -> dict:
    """`override` coalesced into `base` as Helm does with values: maps merge, null deletes, the rest replaces."""
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = helm_merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def nested(dotted: str, value) -> dict:
    *parents, leaf = dotted.split(".")
    node = {leaf: value}
    for part in reversed(parents):
        node = {part: node}
    return node


CHART_DERIVED = {"name", "storage_path", "scaling.num_workers", "scaling.use_gpu", "scaling.cpus_per_worker"}


def bound_samples():
    """(name, run override) at both sides of every range the schema states (beyond it also as a string, as
    `--set` passes numbers), except the fields the chart derives."""
    def walk(schema, path):
        for key, field in schema.get("properties", {}).items():
            if f"{path}{key}" in CHART_DERIVED:
                continue
            branches = [b for b in field.get("anyOf", [field]) if "properties" in b]
            if branches:
                yield from walk(branches[0], f"{path}{key}.")
                continue
            types = field.get("type", [])
            is_float = "number" in types
            step = 0.5 if is_float else 1
            for bound, outside, inside in (("minimum", -step, 0), ("exclusiveMinimum", 0, step),
                                           ("maximum", step, 0), ("exclusiveMaximum", 0, -step)):
                if bound in field:
                    for label, offset in (("outside", outside), ("inside", inside)):
                        value = (float if is_float else int)(field[bound] + offset)
                        yield f"{path}{key} {bound} {label}", nested(f"{path}{key}", value)
                        if is_float and label == "outside":
                            yield f"{path}{key} {bound} {label} (string)", nested(f"{path}{key}", repr(value))

    yield from walk(json_schema(), "")


CROSS_FIELD_SAMPLES = [
    # (name, run override, cluster)
    ("defaults", {}, GPU_CLUSTER),
    ("warmup = steps", {"train": {"warmup_steps": 100}}, GPU_CLUSTER),
    ("warmup < steps", {"train": {"warmup_steps": 99}}, GPU_CLUSTER),
    ("lr as a string", {"train": {"lr": "2e-5"}}, GPU_CLUSTER),
    ("lr not a number", {"train": {"lr": "fast"}}, GPU_CLUSTER),
    ("betas one value", {"train": {"betas": [0.9]}}, GPU_CLUSTER),
    ("betas at 1", {"train": {"betas": [0.9, 1.0]}}, GPU_CLUSTER),
    ("betas as strings", {"train": {"betas": ["0.9", "0.99"]}}, GPU_CLUSTER),
    ("seq_len not an int", {"train": {"seq_len": "abc"}}, GPU_CLUSTER),
    ("unknown key", {"train": {"max_step": 5}}, GPU_CLUSTER),
    ("mode enum", {"mode": "finetune"}, GPU_CLUSTER),
    ("precision enum", {"parallel": {"mixed_precision": "fp16"}}, GPU_CLUSTER),
    ("transport enum", {"preflight": {"expect": {"transport": "pigeon"}}}, GPU_CLUSTER),
    ("preset and path", {"model": {"path": "Qwen/Qwen2.5-1.5B"}}, GPU_CLUSTER),
    ("pretrained without path", {"model": {"init": "pretrained"}}, GPU_CLUSTER),
    ("random without architecture", {"model": {"preset": None}}, GPU_CLUSTER),
    ("sdpa backend with eager", {"model": {"sdpa_backend": "cudnn", "attn_implementation": "eager"}}, GPU_CLUSTER),
    ("sdpa backend with sdpa", {"model": {"sdpa_backend": "cudnn"}}, GPU_CLUSTER),
    ("tokenizer and trained vocab", {"model": {"train_tokenizer_vocab": 512, "tokenizer": "t"}}, GPU_CLUSTER),
    ("synthetic with a source", {"data": {"train": "/x.jsonl"}}, GPU_CLUSTER),
    ("synthetic with a task", {"eval": {"task": "gsm8k"}}, GPU_CLUSTER),
    ("synthetic with a validation source", {"data": {"validation": "/v.jsonl"}}, GPU_CLUSTER),
    ("disk-full drill off a save step", {"debug": {"fail_at_step": 7, "fail_mode": "disk_full"}}, GPU_CLUSTER),
    ("disk-full drill at a save step", {"debug": {"fail_at_step": 50, "fail_mode": "disk_full"},
                                        "checkpoint": {"every_steps": 50}}, GPU_CLUSTER),
    ("synthetic with a sample prompt", {"eval": {"sample_prompt": "Hello"}}, GPU_CLUSTER),
    ("offload and compile", {"parallel": {"cpu_offload": True, "compile": True}}, GPU_CLUSTER),
    ("shard group not dividing", {"parallel": {"shard_group_size": 2}}, GPU_CLUSTER),
    ("shard group dividing", {"parallel": {"shard_group_size": 2}}, CPU_CLUSTER),
    ("bf16 on CPU", {"parallel": {"mixed_precision": "bf16"}}, CPU_CLUSTER),
    ("bf16 on GPU", {"parallel": {"mixed_precision": "bf16"}}, GPU_CLUSTER),
    ("float8 on CPU", {"parallel": {"float8": "rowwise"}}, CPU_CLUSTER),
    ("float8 on GPU", {"parallel": {"float8": "rowwise"}}, GPU_CLUSTER),
    ("float8 with fp32 compute", {"parallel": {"float8": "tensorwise", "mixed_precision": "fp32"}}, GPU_CLUSTER),
    ("LoRA", {"model": {"lora": {"rank": 16, "alpha": 32, "dropout": 0.05}}}, GPU_CLUSTER),
    ("LoRA rank 0", {"model": {"lora": {"rank": 0}}}, GPU_CLUSTER),
    ("LoRA alpha 0", {"model": {"lora": {"rank": 8, "alpha": 0}}}, GPU_CLUSTER),
    ("LoRA dropout 1", {"model": {"lora": {"rank": 8, "dropout": 1}}}, GPU_CLUSTER),
    ("LoRA without targets", {"model": {"lora": {"rank": 8, "targets": []}}}, GPU_CLUSTER),
    ("LoRA with float8", {"model": {"lora": {"rank": 8}}, "parallel": {"float8": "rowwise"}}, GPU_CLUSTER),
    ("merged export of a full fine-tune", {"model": {"lora": {"merged_export": True}}}, GPU_CLUSTER),
    ("merged export without export", {"model": {"lora": {"rank": 8, "merged_export": True}},
                                      "checkpoint": {"export": False}}, GPU_CLUSTER),
    ("merged export", {"model": {"lora": {"rank": 8, "merged_export": True}}}, GPU_CLUSTER),
    ("QLoRA", {"model": {"lora": {"rank": 16, "quantize_base": "nf4"}}}, GPU_CLUSTER),
    ("QLoRA without a rank", {"model": {"lora": {"quantize_base": "nf4"}}}, GPU_CLUSTER),
    ("QLoRA int4", {"model": {"lora": {"rank": 16, "quantize_base": "int4"}}}, GPU_CLUSTER),
    ("QLoRA with float8", {"model": {"lora": {"rank": 16, "quantize_base": "nf4"}}, "parallel": {"float8": "rowwise"}},
     GPU_CLUSTER),
    ("QLoRA with CPU offload", {"model": {"lora": {"rank": 16, "quantize_base": "nf4"}},
                                "parallel": {"cpu_offload": True}}, GPU_CLUSTER),
    ("fault after the last step", {"debug": {"fail_at_step": 101}}, GPU_CLUSTER),
    ("fault at the last step", {"debug": {"fail_at_step": 100}}, GPU_CLUSTER),
    ("loss-spike check off", {"train": {"loss_spike_factor": 0}}, GPU_CLUSTER),
    ("loss-spike factor below 1", {"train": {"loss_spike_factor": 0.5}}, GPU_CLUSTER),
    ("loss-spike factor as a string", {"train": {"loss_spike_factor": "2.5"}}, GPU_CLUSTER),
    ("hang drill, automatic timeout", {"debug": {"fail_at_step": 5, "fail_mode": "hang"}}, GPU_CLUSTER),
    ("hang drill, watchdog off", {"train": {"hang_timeout_s": 0}, "debug": {"fail_at_step": 5, "fail_mode": "hang"}},
     GPU_CLUSTER),
    ("hang drill, timeout as a string", {"train": {"hang_timeout_s": "30"},
                                         "debug": {"fail_at_step": 5, "fail_mode": "hang"}}, GPU_CLUSTER),
    ("spike drill, check off", {"train": {"loss_spike_factor": 0},
                                "debug": {"fail_at_step": 5, "fail_mode": "loss_spike"}}, GPU_CLUSTER),
    ("hang mode without a fault step", {"train": {"hang_timeout_s": 0}, "debug": {"fail_mode": "hang"}}, GPU_CLUSTER),
    ("profile after the last step", {"debug": {"profile_step": 101}}, GPU_CLUSTER),
    ("fault rank beyond the workers", {"debug": {"fail_rank": 1}}, GPU_CLUSTER),
    ("fault rank within the workers", {"debug": {"fail_rank": 1}}, CPU_CLUSTER),
    ("resume blank", {"checkpoint": {"resume": " "}}, GPU_CLUSTER),
    ("resume from a path", {"checkpoint": {"resume": "/mnt/runs/a/checkpoint_00000050"}}, GPU_CLUSTER),
    ("no message sizes", {"preflight": {"sizes_mib": []}}, GPU_CLUSTER),
    ("run name escaping storage_path", {"name": "a/../../b"}, GPU_CLUSTER),
    ("run name with a slash", {"name": "a/b"}, GPU_CLUSTER),
    ("run name ..", {"name": ".."}, GPU_CLUSTER),
    ("run name starting with a dot", {"name": ".exp"}, GPU_CLUSTER),
    ("run name with a space", {"name": "exp 1"}, GPU_CLUSTER),
    ("run name of letters, digits, dots, dashes, underscores", {"name": "Exp.1_b-2..c"}, GPU_CLUSTER),
    ("checkpoint interval longer than the run", {"checkpoint": {"every_steps": 101}}, GPU_CLUSTER),
    ("checkpoint interval as long as the run", {"checkpoint": {"every_steps": 100}}, GPU_CLUSTER),
    ("run shorter than the checkpoint interval", {"train": {"max_steps": 40, "warmup_steps": 5}}, GPU_CLUSTER),
    ("run shorter, checkpoint only at the end", {"train": {"max_steps": 40, "warmup_steps": 5},
                                                 "checkpoint": {"every_steps": 0}}, GPU_CLUSTER),
    ("synthetic evaluation without a held-out fraction", {"data": {"validation_fraction": 0},
                                                           "eval": {"every_steps": 10}}, GPU_CLUSTER),
    ("real data", REAL_DATA, GPU_CLUSTER),
]
REAL_DATA_VARIANTS = [
    ("without a source", {"data": {"train": None}}),
    ("empty source", {"data": {"train": ""}}),
    ("empty source path", {"data": {"train": {"path": ""}}}),
    ("hub id with two slashes", {"data": {"train": "hf:a/b/c"}}),
    ("hub id", {"data": {"train": {"path": "hf:openai/gsm8k", "subset": "main", "revision": "abc"}}}),
    ("revision of a file", {"data": {"train": {"path": "/x.jsonl", "revision": "abc"}}}),
    ("subset of a file", {"data": {"train": {"path": "/x.jsonl", "subset": "main"}}}),
    ("split of a file", {"data": {"train": {"path": "/x.jsonl", "split": "test"}}}),
    ("validation hub id with two slashes", {"data": {"validation": "hf:a/b/c"}}),
    ("revision of a validation file", {"data": {"validation": {"path": "/v.jsonl", "revision": "abc"}}}),
    ("subset of a validation file", {"data": {"validation": {"path": "/v.jsonl", "subset": "main"}}}),
    ("split of a validation file", {"data": {"validation": {"path": "/v.jsonl", "split": "test"}}}),
    ("unknown builtin validation", {"data": {"validation": "builtin:poems"}}),
    ("builtin text as prompt/completion", {"data": {"train": "builtin:python-docs"}}),
    ("unknown builtin", {"data": {"train": "builtin:poems"}}),
    ("builtin text", {"data": {"format": "text", "train": "builtin:python-docs"}, "eval": {"task": None}}),
    ("task on text", {"data": {"format": "text"}}),
    ("chat", {"data": {"format": "chat", "chat_template": "{{ messages }}"}}),
    ("chat template without chat", {"data": {"chat_template": "{{ messages }}"}}),
    ("task without held-out rows", {"data": {"validation_fraction": 0}}),
    ("task with a validation source", {"data": {"validation_fraction": 0, "validation": "/v.jsonl"}}),
    ("no held-out data, export", {"data": {"validation_fraction": 0}, "eval": {"task": None}}),
    ("no held-out data, evaluation", {"data": {"validation_fraction": 0}, "eval": {"task": None, "every_steps": 10},
                                      "checkpoint": {"export": False}}),
    ("no held-out data, evaluation and export", {"data": {"validation_fraction": 0},
                                                 "eval": {"task": None, "every_steps": 10}}),
    ("no held-out data, neither evaluation nor export", {"data": {"validation_fraction": 0}, "eval": {"task": None},
                                                         "checkpoint": {"export": False}}),
    ("no held-out fraction, a validation source", {"data": {"validation_fraction": 0, "validation": "/v.jsonl"},
                                                   "eval": {"task": None, "every_steps": 10}}),
    ("validation fraction 1", {"data": {"validation_fraction": 1}}),
    ("empty column", {"data": {"columns": {"prompt": ""}}}),
    ("no tokenizer", {"model": {"init": "random", "preset": "qwen2-tiny", "path": None}}),
    ("trained tokenizer", {"model": {"init": "random", "preset": "qwen2-tiny", "path": None, "train_tokenizer_vocab": 512}}),
    ("small trained vocabulary", {"model": {"init": "random", "preset": "qwen2-tiny", "path": None, "train_tokenizer_vocab": 259}}),
    ("synthetic after all", {"data": {"format": "synthetic"}}),
    ("dpo on prompt/completion", {"train": {"objective": "dpo"}}),
    ("preference without dpo", {"data": {"format": "preference"}, "eval": {"task": None}}),
    ("preference, a task without its source", {"data": {"format": "preference"}, "train": {"objective": "dpo"}}),
    ("preference with a task source", {"data": {"format": "preference", "task_source": "/mnt/runs/gsm8k/test.jsonl"},
                                       "train": {"objective": "dpo", "dpo": {"beta": 0.2, "nll_weight": 1.0}}}),
    ("task source without a task", {"data": {"task_source": "/t.jsonl"}, "eval": {"task": None}}),
    ("task source hub id with two slashes", {"data": {"task_source": "hf:a/b/c"}}),
    *((f"{option} of a task source file", {"data": {"task_source": {"path": "/t.jsonl", option: "x"}}})
      for option in ("revision", "subset", "split")),
    ("task source instead of held-out rows", {"data": {"validation_fraction": 0, "task_source": "/t.jsonl"},
                                              "checkpoint": {"export": False}}),
    ("pairs", {"mode": "pairs", "pairs": {"samples": 4, "temperature": 0.7, "top_p": 0.95}}),
    ("pairs without a task", {"mode": "pairs", "eval": {"task": None}}),
    ("pairs from text", {"mode": "pairs", "data": {"format": "text"}, "eval": {"task": None}}),
    ("pairs without held-out rows", {"mode": "pairs", "data": {"validation_fraction": 0}}),
    *[(f"prompt template {template!r}", {"data": {"prompt_template": template}})
      for template in ("{0}", "{}", "{prompt", "prompt}", "{a.b}", "{prompt!r}", "{prompt!}", "{prompt:>10}",
                       "{{literal}} {prompt}", "{{{prompt}}}", "Q: {question} ({answer})")],
]
SAMPLES = [
    *[(name, override, GPU_CLUSTER) for name, override in bound_samples()],
    *CROSS_FIELD_SAMPLES,
    *[(f"real data: {name}", helm_merged(REAL_DATA, override), GPU_CLUSTER) for name, override in REAL_DATA_VARIANTS],
]


def job_verdict(override: dict, cluster) -> str:
    """'' when the job accepts the run config the chart would render, else its error."""
    _, scaling = cluster
    run = helm_merged(DEFAULT_RUN, override)
    name = run.get("name") or "exp1"  # run.name, else the release name
    run = helm_merged(run, {"name": name, "storage_path": "/mnt/runs", "scaling": scaling})
    try:
        load_dict(run)
    except ConfigError as e:
        return str(e)
    return ""


def chart_verdict(override: dict, cluster, values: Path) -> str:
    """'' when `helm template` renders (`values`: a file of its own for this sample), else its error."""
    values.write_text(yaml.safe_dump({**cluster[0], "run": override}))
    result = helm(*template_args(args=("-f", str(values), "--show-only", "templates/configmap-run.yaml")), check=False)
    return "" if result.returncode == 0 else result.stderr.split("Error: ", 1)[-1]


def rule_fields() -> set[str]:
    """The fields the job's rules lead with (`job.rules.RULES`, plus `validate`'s own): each must be the field a
    sample is rejected for, so a rule added to the job needs a sample here."""
    source = inspect.getsource(job_config.validate)
    return {rule.field for rule in rules.RULES} | set(re.findall(r"errors\.append\(\s*f?[\"']([a-z_]+(?:\.[a-z_]+)*):", source))


NUMBER_BOUND = re.compile(r"run\.\S+: must be (>=|>|<=|<) ")
"""The chart's own bound check of a number given as a string (ray-finetune.number), in the schema's words."""


def test_chart_and_job_reject_the_same_run_configs(tmp_path):
    """On every sample the chart and the job agree; where the chart's own check (a rule, not the schema) refuses,
    it says what the job says, word for word (field paths prefixed `run.`)."""
    assert len(SAMPLES) >= 120
    # helm renders two samples at once (each its own process): the suite's longest chart test otherwise.
    with ThreadPoolExecutor(2) as pool:
        charts = list(pool.map(lambda i: chart_verdict(SAMPLES[i][1], SAMPLES[i][2], tmp_path / f"values-{i}.yaml"),
                               range(len(SAMPLES))))
    disagreements, rejected, rejected_for, same_words = [], 0, set(), 0
    for (name, override, cluster), chart in zip(SAMPLES, charts, strict=True):
        job = job_verdict(override, cluster)
        if bool(job) != bool(chart):
            disagreements.append(f"{name}: job {job or 'accepts'}; chart {chart.strip() or 'accepts'}")
        elif job:
            rejected += 1
            field = re.sub(r"\[\d+\]", "", job.split(":")[0])
            *parent, leaf = field.split(".")
            # A source written as a string (its `path`) is named by the field that holds the string.
            named = (names_field(chart, f"/run/{field.replace('.', '/')}")
                     or (names_field(chart, f"/run/{'/'.join(parent)}") and (leaf in chart or leaf == "path")))
            if not named:
                disagreements.append(f"{name}: the chart's error does not name {field}: {chart.strip()}")
            rejected_for.add(field)
            said = chart.strip().split("): ", 1)[-1].splitlines()[0] if "execution error" in chart else None
            if said is not None and any(said.startswith(GENERATOR.prefixed(f"{rule.field}: ")) for rule in rules.RULES) \
                    and not NUMBER_BOUND.match(said):
                if said not in {GENERATOR.prefixed(m) for m in job.splitlines()}:
                    disagreements.append(f"{name}: the chart says {said!r}, the job {job.splitlines()}")
                same_words += 1
    assert not disagreements, "\n".join(disagreements)
    assert {"name", "checkpoint.every_steps", "eval.every_steps", "checkpoint.export"} <= rule_fields()
    assert rule_fields() <= rejected_for, f"rules no sample is rejected for: {rule_fields() - rejected_for}"
    assert rejected > len(SAMPLES) / 3  # the sample exercises the rules, not only valid configs
    assert same_words > 40, same_words  # the rules' words were compared, not only the schema's refusals


# ---------------------------------------------------------------------------------------------------------------------
# What the objects say
# ---------------------------------------------------------------------------------------------------------------------


def run_container_script(container: dict, env: dict) -> subprocess.CompletedProcess:
    """A rendered `python -c` container run here, with its literal env values overridden by `env`."""
    literal = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    return subprocess.run([sys.executable, "-c", container["args"][0]], env={**os.environ, **literal, **env},
                          capture_output=True, text=True)


def test_staging_copies_once_then_checks_the_data(tmp_path):
    source = tmp_path / "bucket" / "gsm8k"
    source.mkdir(parents=True)
    (source / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    claim = tmp_path / "claim"
    args = ["-f", "values/gsm8k.yaml", "--set", "run.data.train=/mnt/runs/datasets/gsm8k/train.jsonl",
            "--set-json", f'staging.copies=[{{"from":"{source}","to":"datasets/gsm8k"}}]']
    objects = render(*args)
    (init,) = dict(ray_pod_specs(objects))["head"]["template"]["spec"]["initContainers"]
    assert [m["mountPath"] for m in init["volumeMounts"]] == ["/opt/job/job", "/etc/job", "/mnt/runs"]
    assert [name for name, g in ray_pod_specs(objects) if "initContainers" in g["template"]["spec"]] == ["head"]
    config = tmp_path / "run.yaml"  # the rendered run config, its storage here
    config.write_text(yaml.safe_dump({**run_config(objects), "storage_path": str(claim)}))
    paths = {"STAGING_ROOT": str(claim), "DATA_SOURCES": json.dumps({"run.data.train": f"{claim}/datasets/gsm8k/train.jsonl"}),
             "RUN_CONFIG": str(config), "PYTHONPATH": str(REPO), "POD_NAME": "exp1-head"}
    first = run_container_script(init, paths)
    assert first.returncode == 0, first.stderr
    assert (claim / "datasets" / "gsm8k" / "train.jsonl").read_text() == (source / "train.jsonl").read_text()
    assert "is readable" in first.stdout and not (claim / "exp1" / "run.json").exists()
    assert "already copied" in run_container_script(init, paths).stdout
    # What cannot start is said, recorded from this pod and told the RayJob (here no API server: said so); the head
    # starts, for its driver to end the run (tests/test_failures.py).
    missing = run_container_script(init, {**paths, "DATA_SOURCES": json.dumps({"run.data.train": f"{claim}/nothing.jsonl"})})
    line = f"run.data.train: {claim}/nothing.jsonl does not exist: copy it there (staging.copies) or point run.data.train at it"
    assert missing.returncode == 0 and line in missing.stdout, missing.stdout + missing.stderr
    assert "no Event: not running in Kubernetes (KUBERNETES_SERVICE_HOST unset)" in missing.stdout
    record = json.loads((claim / "exp1" / "run.json").read_text())
    assert (record["status"], record["error"]["class"], record["pod"]["name"]) == ("failed", "data", "exp1-head")
    assert line in record["error"]["message"]
    absent = tmp_path / "bucket" / "absent"
    uncopied = run_container_script(init, {**paths, "STAGING_COPIES": json.dumps([{"from": str(absent), "to": "x"}])})
    assert uncopied.returncode == 0 and f"staging.copies[0]: cannot copy {absent} -> {claim}/x: " in uncopied.stdout
    assert "staging.copies[0]" in json.loads((claim / "exp1" / "run.json").read_text())["error"]["message"]
    # Nothing to copy or check: no init container; a bucket cannot be a copy target.
    assert "initContainers" not in dict(ray_pod_specs(render()))["head"]["template"]["spec"]
    assert "staging.copies" in render_error("--set", "storage.uri=s3://b/p", "--set-json", 'staging.copies=[{"from":"/d","to":"d"}]')


def test_set_passes_floats_as_numbers():
    args = ["--set", "run.train.lr=2e-5", "--set", "run.data.validation_fraction=0.1", "--set", "run.train.betas={0.9,0.99}",
            "--set", "run.logging.peak_flops=1.2e14"]
    config = run_config(render(*args))
    assert config["train"]["lr"] == 2e-5 and config["train"]["betas"] == [0.9, 0.99]
    assert config["logging"]["peak_flops"] == 1.2e14 and config["data"]["validation_fraction"] == 0.1
    assert load_dict(config).train.lr == 2e-5
    assert "run.train.min_lr_ratio: must be <= 1, got 1.5" in render_error("--set", "run.train.min_lr_ratio=1.5")
    assert names_field(render_error("--set", "run.train.lr=fast"), "/run/train/lr")


def test_a_progress_bar_written_on_in_values_is_on(tmp_path):
    """YAML 1.1 reads `on` as true in a values file: the schema takes it and the job reads it as `on`."""
    values = tmp_path / "values.yaml"
    values.write_text("run:\n  logging:\n    progress_bar: on\n")
    assert load_dict(run_config(render("-f", str(values)))).logging.progress_bar == "on"


def test_works_as_a_subchart(tmp_path):
    umbrella = tmp_path / "umbrella"
    (umbrella / "charts").mkdir(parents=True)
    shutil.copytree(chart_copy(tmp_path), umbrella / "charts" / "ray-finetune")
    (umbrella / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "ray-finetune", "version": job_version, "repository": "file://charts/ray-finetune"}],
    }))
    (umbrella / "values.yaml").write_text(yaml.safe_dump({
        "global": {"imageRegistry": "registry.example.com"},
        "ray-finetune": {"run": {"train": {"max_steps": 50}}},
    }))
    objects = render(release="team", chart=str(umbrella))
    assert run_config(objects)["train"]["max_steps"] == 50
    for obj in objects:
        validate(obj)


def test_worker_groups_replace_the_default_group():
    names = lambda *args: [name for name, _ in ray_pod_specs(render(*args))]
    assert names() == ["head", "workers"]
    assert names("--set", "workerGroups.big.replicas=2") == ["head", "big"]
    groups = dict(ray_pod_specs(render("--set", "workerGroups.big.replicas=2", "--set", "worker.gpus=2")))
    assert groups["big"]["replicas"] == 2 and groups["big"]["rayStartParams"]["num-gpus"] == "2"
    assert run_config(render("--set", "workerGroups.big.replicas=2", "--set", "worker.gpus=2"))["scaling"]["num_workers"] == 4
    by_group, by_default = (dict(ray_pod_specs(render("--set", arg))) for arg in ("workerGroups.workers.replicas=3", "worker.replicas=3"))
    assert by_group.keys() == by_default.keys() and by_group["workers"]["replicas"] == by_default["workers"]["replicas"] == 3


def test_profile_order_cannot_decide_the_memory_fit():
    error = render_error("-f", "values/eks-g6-efa.yaml", "-f", "values/synthetic.yaml")
    assert "hardware.maxTokensPerDevice" in error and "give the hardware profile last" in error
    render("-f", "values/synthetic.yaml", "-f", "values/eks-g6-efa.yaml")


def all_pods(objects):
    """(role, pod spec) of every pod the objects create: Ray nodes, the submitter, the test pod."""
    for group, spec in ray_pod_specs(objects):
        yield group, spec["template"]["spec"]
    for rayjob in by_kind(objects, "RayJob"):
        if "submitterPodTemplate" in rayjob["spec"]:
            yield "submitter", rayjob["spec"]["submitterPodTemplate"]["spec"]
    for pod in by_kind(objects, "Pod"):
        yield "test", pod["spec"]


def restricted_violations(spec) -> list[str]:
    """What breaks Pod Security "restricted" (v1.33) in a pod spec."""
    pod, problems = spec.get("securityContext", {}), []
    for c in spec["containers"]:
        context = c.get("securityContext", {})
        if not context.get("runAsNonRoot", pod.get("runAsNonRoot")):
            problems.append(f"{c['name']}: runAsNonRoot")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c['name']}: allowPrivilegeEscalation")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{c['name']}: capabilities {capabilities}")
        seccomp = context.get("seccompProfile", pod.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{c['name']}: seccompProfile")
    if any("hostPath" in v for v in spec.get("volumes", [])):
        problems.append("hostPath volume")
    return problems


def test_security_contexts_per_role():
    for args in ([], ["-f", "values/eks-g6-efa.yaml"], ["-f", "values/cpu-smoke.yaml"], ["--set", "rayCluster.create=true"]):
        objects = render(*args)
        efa = "values/eks-g6-efa.yaml" in args
        roles = set()
        for role, spec in all_pods(objects):
            roles.add(role)
            container = spec["containers"][0]
            added = container["securityContext"].get("capabilities", {}).get("add", [])
            if efa and role not in ("head", "submitter", "test"):
                assert added == ["IPC_LOCK"], role
                assert restricted_violations(spec) == [f"{container['name']}: capabilities {container['securityContext']['capabilities']}"]
            else:
                assert restricted_violations(spec) == [], (args, role)
            assert container["securityContext"].get("readOnlyRootFilesystem", False) is (role == "test")
        assert {"head", "test"} <= roles
    head = dict(all_pods(render("--set", "head.securityContext.readOnlyRootFilesystem=true")))["head"]
    assert head["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def test_image_pull_secrets_on_every_pod():
    roles = []
    for role, spec in all_pods(render("--set", "imagePullSecrets={regcred,mirror}", "--set", "rayCluster.create=true")):
        roles.append(role)
        assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}], role
    assert {"head", "submitter", "test"} <= set(roles)
    assert all("imagePullSecrets" not in spec for _, spec in all_pods(render())), "none without imagePullSecrets"


def test_ray_endpoints_are_closed_and_authenticated():
    objects = render()
    policy = one(objects, "NetworkPolicy")
    selector = {"app.kubernetes.io/name": "ray-finetune", "app.kubernetes.io/instance": "exp1"}
    assert policy["spec"]["podSelector"]["matchLabels"] == selector and policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": selector}},
                            {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}]
    # Every pod of the release carries the selected labels, so each reaches the others.
    pod_labels = [g["template"]["metadata"]["labels"] for _, g in ray_pod_specs(objects)]
    pod_labels += [one(objects, "RayJob")["spec"]["submitterPodTemplate"]["metadata"]["labels"], one(objects, "Pod")["metadata"]["labels"]]
    assert all(selector.items() <= labels.items() for labels in pod_labels)
    assert one(objects, "RayJob")["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    extra = render("--set", "networkPolicy.extraFrom[0].namespaceSelector.matchLabels.team=ml")
    assert one(extra, "NetworkPolicy")["spec"]["ingress"][0]["from"][-1] == {"namespaceSelector": {"matchLabels": {"team": "ml"}}}
    off = render("--set", "networkPolicy.enabled=false", "--set", "rayAuth=false")
    assert not by_kind(off, "NetworkPolicy") and "authOptions" not in one(off, "RayJob")["spec"]["rayClusterSpec"]


def test_common_labels_annotations_and_namespace_on_every_object():
    args = ["--set", "commonLabels.team=ml", "--set", "commonAnnotations.owner=ml-platform", "--set", "rayCluster.create=true",
            "--set", "rayCluster.podDisruptionBudget=true", "--set", "podLabels.cost-center=ml-42"]
    objects = render(*args)
    assert {o["kind"] for o in objects} >= {"RayJob", "RayCluster", "PodDisruptionBudget", "NetworkPolicy", "PersistentVolumeClaim"}
    for obj in objects:
        validate(obj)
        meta = obj["metadata"]
        assert meta["namespace"] == "experiments", obj["kind"]
        assert meta["labels"]["team"] == "ml" and meta["annotations"]["owner"] == "ml-platform", obj["kind"]
    pod_metadata = [g["template"]["metadata"] for _, g in ray_pod_specs(objects)]
    pod_metadata += [o["spec"]["submitterPodTemplate"]["metadata"] for o in by_kind(objects, "RayJob")]
    pod_metadata += [o["metadata"] for o in by_kind(objects, "Pod")]
    for meta in pod_metadata:
        assert meta["labels"]["team"] == "ml" and meta["labels"]["cost-center"] == "ml-42"
        assert meta["annotations"]["owner"] == "ml-platform"
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"] == {"maxUnavailable": 0, "selector": {"matchLabels": {"ray.io/cluster": one(objects, "RayCluster")["metadata"]["name"]}}}


def test_run_config_is_derived_from_release_storage_and_worker_groups():
    config = run_config(render("-f", "values/synthetic.yaml", "-f", "values/eks-g6-efa.yaml", release="exp7"))
    assert config["name"] == "exp7"
    assert config["storage_path"] == "/mnt/runs"
    assert config["scaling"] | {"max_failures": 0} == {
        "num_workers": 8, "use_gpu": True, "cpus_per_worker": 11, "max_failures": 0
    }
    # The hardware profile, given last, fits the fastest workload settings into 24 GB L4s.
    assert (config["train"]["micro_batch_size"], config["train"]["loss_chunk_size"]) == (1, 1024)
    assert config["parallel"]["compile"] and config["parallel"]["reshard_after_forward"]
    assert run_config(render("--set", "storage.uri=s3://b/p"))["storage_path"] == "s3://b/p"
    cpu = run_config(render("-f", "values/cpu-smoke.yaml"))["scaling"]
    assert (cpu["num_workers"], cpu["use_gpu"], cpu["cpus_per_worker"]) == (2, False, 1)
    named = run_config(render("--set", "run.name=shared-run", "--set", "run.scaling.num_workers=1"))
    assert named["name"] == "shared-run" and named["scaling"]["num_workers"] == 1


def test_one_pod_template_for_head_and_workers():
    for args in (["-f", "values/eks-g6-efa.yaml"], ["--set", "rayCluster.create=true"]):
        groups = dict(ray_pod_specs(render(*args)))
        head, worker = groups["head"]["template"], groups["workers"]["template"]
        assert head["spec"]["volumes"] == worker["spec"]["volumes"]
        assert head["metadata"]["annotations"] == worker["metadata"]["annotations"]
        head_env = [e["name"] for e in head["spec"]["containers"][0]["env"]]
        assert head_env == [e["name"] for e in worker["spec"]["containers"][0]["env"]]


def test_ray_pods_get_the_job_environment_and_mounts():
    objects = render("--set", "huggingface.existingSecret=hf", "--set", "image.digest=sha256:" + "b" * 64)
    expected_image = "public.ecr.aws/deep-learning-containers/ray@sha256:" + "b" * 64
    for _, group in ray_pod_specs(objects):
        spec = group["template"]["spec"]
        container = spec["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        assert set(env) >= {"JOB_CHART", "JOB_CHART_VERSION", "JOB_RELEASE", "JOB_VALUES_SHA256", "JOB_IMAGE",
                            "POD_NAME", "POD_NAMESPACE", "HF_TOKEN", "PYTHONPATH"}
        assert env["JOB_IMAGE"]["value"] == container["image"] == expected_image
        assert env["JOB_RELEASE"]["value"] == "exp1" and env["JOB_CHART"]["value"] == "ray-finetune"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}
        assert re.fullmatch(r"[0-9a-f]{64}", env["JOB_VALUES_SHA256"]["value"])
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/opt/job/job", "/etc/job", "/mnt/runs", "/dev/shm"} <= mounts
        assert env["PYTHONPATH"]["value"] == "/opt/job"
        assert spec["serviceAccountName"] == "exp1-ray-finetune"
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    rayjob = one(objects, "RayJob")
    assert rayjob["spec"]["entrypoint"] == "python -m job --config /etc/job/run.yaml"


def test_job_code_configmap_ships_the_package():
    objects = render()
    cm = [c for c in by_kind(objects, "ConfigMap") if "__main__.py" in c["data"]][0]
    shipped = {p.relative_to(REPO / "job").as_posix() for p in job_files()}
    assert set(cm["data"]) == {path.replace("/", "-") for path in shipped}
    for path in shipped:
        assert cm["data"][path.replace("/", "-")] == (REPO / "job" / path).read_text()
    # Each pod's volume puts every key back at its path in the package tree.
    for _, group in ray_pod_specs(objects):
        (volume,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "job-code"]
        assert {item["path"] for item in volume["configMap"]["items"]} == shipped
        assert all(item["key"] == item["path"].replace("/", "-") for item in volume["configMap"]["items"])
    assert len(json.dumps(cm["data"])) < 900_000, "a ConfigMap holds at most 1 MiB"


def test_num_gpus_follows_the_gpu_request():
    for name, group in ray_pod_specs(render("-f", "values/eks-g6-efa.yaml")):
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert group["rayStartParams"]["num-gpus"] == str(limits.get("nvidia.com/gpu", 0))
        if name != "head":
            assert limits["vpc.amazonaws.com/efa"] == 1 and limits["nvidia.com/gpu"] == 4


def test_efa_switch_sets_the_nccl_environment():
    efa_env = ["--set", "efa.env.FI_PROVIDER=efa", "--set", "efa.env.NCCL_DEBUG=INFO"]
    for args, expected in (([*efa_env, "-f", "values/eks-g6-efa.yaml"], True), (efa_env, False)):
        for _, group in ray_pod_specs(render(*args)):
            env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
            assert (env.get("FI_PROVIDER") == "efa" and env.get("NCCL_DEBUG") == "INFO") is expected
    # The default image sets them itself: the hardware profile adds none.
    for _, group in ray_pod_specs(render("-f", "values/eks-g6-efa.yaml")):
        env = {e["name"] for e in group["template"]["spec"]["containers"][0]["env"]}
        assert not env & {"FI_PROVIDER", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME"}


def test_checksums_follow_run_config_and_code():
    def annotations(*args):
        _, head = next(ray_pod_specs(render(*args)))
        return head["template"]["metadata"]["annotations"]

    base = annotations()
    changed = annotations("--set", "run.train.max_steps=70")
    assert changed["checksum/config"] != base["checksum/config"]
    assert changed["checksum/job"] == base["checksum/job"]


def test_rayjob_name_changes_with_content_not_run_name():
    base, changed = render(), render("--set", "run.train.max_steps=70")
    assert one(base, "RayJob")["metadata"]["name"] != one(changed, "RayJob")["metadata"]["name"]
    assert run_config(base)["name"] == run_config(changed)["name"] == "exp1"
    assert one(base, "RayJob")["metadata"]["name"] == one(render(), "RayJob")["metadata"]["name"]
    long = one(render(release="a-very-long-release-name-for-an-experiment-x"), "RayJob")["metadata"]["name"]
    assert len(long) <= 47


def test_warm_cluster_is_selected_not_embedded():
    objects = render("--set", "rayCluster.create=true", "--set", "kueue.queueName=team-a")
    rayjob, cluster = one(objects, "RayJob"), one(objects, "RayCluster")
    assert "rayClusterSpec" not in rayjob["spec"] and "suspend" not in rayjob["spec"]
    assert rayjob["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert cluster["spec"]["suspend"] is True
    assert cluster["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"


def test_an_ended_job_is_deleted_at_its_ttl_whatever_its_ending():
    """The chart's deletion rules: ttlSecondsAfterFinished after a success or any failure (`jobDeploymentStatus:
    Failed`, which deadlines reach with jobStatus RUNNING), the RayJob itself, and so its cluster and submitter Job.
    None with `shutdownAfterJobFinishes` (the cluster only), on the warm cluster (KubeRay applies none there), or
    where the user's rules replace them."""
    spec = one(render("--set", "rayJob.ttlSecondsAfterFinished=42"), "RayJob")["spec"]
    assert spec["deletionStrategy"] == {"deletionRules": [
        {"policy": "DeleteSelf", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 42}},
        {"policy": "DeleteSelf", "condition": {"jobDeploymentStatus": "Failed", "ttlSeconds": 42}}]}
    assert spec["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in spec
    spec = one(render("--set", "rayJob.shutdownAfterJobFinishes=true"), "RayJob")["spec"]
    assert "deletionStrategy" not in spec and (spec["shutdownAfterJobFinishes"], spec["ttlSecondsAfterFinished"]) == (True, 600)
    assert "deletionStrategy" not in one(render("--set", "rayCluster.create=true"), "RayJob")["spec"]
    rules = yaml.safe_load((REPO / "tests" / "fixtures" / "deletion-rules.yaml").read_text())["rayJob"]["deletionRules"]
    spec = one(render("-f", "tests/fixtures/deletion-rules.yaml"), "RayJob")["spec"]
    assert spec["deletionStrategy"]["deletionRules"] == rules


def test_kueue_suspends_the_rayjob():
    rayjob = one(render("--set", "kueue.queueName=team-a", "--set", "rayJob.shutdownAfterJobFinishes=true"), "RayJob")
    assert rayjob["spec"]["suspend"] is True and rayjob["spec"]["shutdownAfterJobFinishes"] is True
    assert "deletionStrategy" not in rayjob["spec"]
    assert rayjob["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"


def test_storage_modes():
    assert one(render(), "PersistentVolumeClaim")["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for args in (["--set", "storage.uri=s3://b/p"], ["--set", "storage.existingClaim=mine"]):
        assert not by_kind(render(*args), "PersistentVolumeClaim")
    _, head = next(ray_pod_specs(render("--set", "storage.existingClaim=mine")))
    claims = [v["persistentVolumeClaim"]["claimName"] for v in head["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == ["mine"]


def test_role_is_least_privilege():
    def rules(*args: str) -> tuple[list, str]:
        objects = render(*args)
        return one(objects, "Role")["rules"], one(objects, "RayJob")["metadata"]["name"]

    def base(rayjob: str) -> list:
        return [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["pods"], "resourceNames": ["exp1-ray-finetune-test"], "verbs": ["patch"]},
            {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "resourceNames": [rayjob], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["exp1-ray-finetune-run"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        ]

    # monitoring.rayJob (default): annotations on this release's RayJob alone.
    role, rayjob = rules()
    assert role == base(rayjob) + [
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "resourceNames": [rayjob], "verbs": ["patch"]},
    ]
    role, rayjob = rules("--set", "monitoring.rayJob=false")
    assert role == base(rayjob)


def test_no_container_has_a_variable_twice():
    """The API server refuses a pod template with a variable twice in one container's env (`helm template` and the
    CRD schema do not): the staging's JOB_RAYJOB beside the shared env's, with and without monitoring.rayJob."""
    for args in ((), ("--set", "monitoring.rayJob=false")):
        for name, group in ray_pod_specs(render(*args, "-f", "values/gsm8k.yaml", "--set", "run.data.train=/mnt/runs/datasets/gsm8k/train.jsonl")):
            spec = group["template"]["spec"]
            for container in spec["containers"] + spec.get("initContainers", []):
                names = [e["name"] for e in container.get("env", [])]
                assert len(names) == len(set(names)), (args, name, container["name"], names)
                if container["name"] == "stage-data":
                    assert "JOB_RAYJOB" in names, (args, names)


def test_the_driver_is_told_its_rayjob_only_with_monitoring_rayjob():
    for args, told in (((), True), (("--set", "monitoring.rayJob=false"), False)):
        objects = render(*args)
        rayjob = one(objects, "RayJob")["metadata"]["name"]
        for _, group in ray_pod_specs(objects):
            env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
            assert (env.get("JOB_RAYJOB") == rayjob) if told else "JOB_RAYJOB" not in env


def test_pod_monitor_scrapes_every_ray_pod_of_the_release_and_the_dashboard_shows_every_run_metric():
    """The PodMonitor selects the release's Ray pods (head and workers, not the submitter) on KubeRay's `metrics`
    port; the dashboard ConfigMap carries the sidecar's label and plots each gauge the driver exports, and no
    other (job/driver/follow.py RunMetrics)."""
    objects = render("--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.grafanaDashboard.enabled=true",
                     "--set", "monitoring.podMonitor.labels.release=prometheus")
    monitor = one(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "ray-finetune",
                                                          "app.kubernetes.io/instance": "exp1", "ray.io/is-ray-node": "yes"}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    for _, group in ray_pod_specs(objects):
        assert monitor["spec"]["selector"]["matchLabels"].items() - {"ray.io/is-ray-node": "yes"}.items() <= \
            group["template"]["metadata"]["labels"].items()
    (dashboard,) = [o for o in by_kind(objects, "ConfigMap") if o["metadata"]["name"] == "exp1-ray-finetune-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["ray-finetune.json"])
    plotted = {m for p in board["panels"] for t in p["targets"] for m in re.findall(r"ray_(finetune_\w+)\{", t["expr"])}
    exported = {f"finetune_{name}" for name, _ in follow.GAUGES} | {"finetune_task_score", "finetune_phase_seconds"}
    assert plotted == exported
    assert not by_kind(render(), "PodMonitor") and len(by_kind(render(), "ConfigMap")) == 2  # off by default


def notes(*args: str) -> str:
    if helm("version", "--template", "{{.Version}}").stdout.startswith("v3."):
        pytest.skip("helm v3's install --dry-run=client still needs a cluster: NOTES.txt is checked with helm v4")
    out = helm("install", "exp1", ".", "--dry-run=client", "--namespace", "experiments", *args).stdout
    return out[out.index("NOTES:"):]


def test_notes_give_commands_for_this_release():
    text = notes()
    rayjob = one(render(), "RayJob")["metadata"]["name"]
    for command in (f"kubectl -n experiments get rayjob {rayjob} -w", f"kubectl -n experiments logs -f job/{rayjob}",
                    "helm test exp1 -n experiments --logs", "/mnt/runs/exp1/metrics.jsonl",
                    "kubectl -n experiments cp exp1-copy:/mnt/runs/exp1 ./exp1", "python -m job report ./exp1",
                    "-o jsonpath='{.data.auth_token}' | base64 -d", f"kubectl -n experiments describe rayjob {rayjob}",
                    "/mnt/runs/exp1/logs/<driver start>/driver.log", 'ray_finetune_*{run="exp1"}'):
        assert command in text
    assert "-c ray-head -- python -m job runs /mnt/runs\n" in text  # the index, from the pod that mounts the claim
    on_s3 = notes("--set", "storage.uri=s3://b/p")
    assert "aws s3 cp --recursive s3://b/p/exp1 ./exp1" in on_s3
    assert "   python -m job runs s3://b/p\n   python -m job report --storage s3://b/p exp1\n" in on_s3


def test_notes_say_what_pods_install_and_warn_about_tags():
    image = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
    text = notes()
    assert "installs" not in text
    assert f"crane digest {image}" in text and f"docker buildx imagetools inspect {image}" in text
    assert "WARNING" not in notes("--set", "image.digest=sha256:" + "c" * 64)
    smoke = notes("-f", "values/cpu-smoke.yaml")
    listed = smoke[smoke.index("each Ray pod installs"):].splitlines()[1:5]
    assert [line.strip() for line in listed] == yaml.safe_load((REPO / "values/cpu-smoke.yaml").read_text())["runtimeEnv"]["pip"]
    assert "s3fs==2026.4.0" in notes("--set", "runtimeEnv.pip.packages={s3fs==2026.4.0}")


# ---------------------------------------------------------------------------------------------------------------------
# Packaging
# ---------------------------------------------------------------------------------------------------------------------


def test_values_reference_is_generated_from_values_yaml():
    subprocess.run([sys.executable, "scripts/gen-chart-readme.py", "--check"], cwd=REPO, check=True)
    reference = (REPO / "docs" / "values.md").read_text()
    for key in ("image.digest", "worker.gpus", "networkPolicy.enabled", "staging.copies", "run"):
        assert f"| {key} |" in reference


def test_chart_metadata_is_publishable():
    chart = yaml.safe_load((REPO / "Chart.yaml").read_text())
    images = yaml.safe_load(chart["annotations"]["artifacthub.io/images"])
    values = yaml.safe_load((REPO / "values.yaml").read_text())
    assert images[0]["image"] == f"{values['image']['repository']}:{values['image']['tag']}"
    assert all({"kind", "description"} <= set(c) for c in yaml.safe_load(chart["annotations"]["artifacthub.io/changes"]))
    # What the repository cannot state truthfully (public address, people, logo, licence) is left empty, never
    # invented, and docs/chart.md lists it for the team that publishes.
    checklist = (REPO / "docs" / "chart.md").read_text().partition("## Before publishing")[2].partition("\n## ")[0]
    for key in ("home", "sources", "maintainers", "icon"):
        assert chart.get(key) or f"| `{key}` |" in checklist, f"Chart.yaml {key}: neither set nor in the checklist"
    license = "artifacthub.io/license"
    assert chart["annotations"].get(license) or f"`annotations: {license}`" in checklist


def test_chart_version_tracks_the_job_package():
    chart = yaml.safe_load((REPO / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == job_version


def chart_copy(tmp_path):
    """The chart's files (as a fresh clone has them) in a temporary directory."""
    copy = tmp_path / "chart"
    copy.mkdir()
    for name in ("Chart.yaml", "Chart.lock", "values.yaml", "values.schema.json", ".helmignore"):
        shutil.copy(REPO / name, copy / name)
    for name in ("templates", "charts/raylib", "job", "values"):
        shutil.copytree(REPO / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.tgz"))
    return copy


def test_dependency_build_reproduces_chart_lock_offline(tmp_path):
    copy = chart_copy(tmp_path)
    helm("dependency", "build", ".", cwd=copy)
    assert (copy / "Chart.lock").read_text() == (REPO / "Chart.lock").read_text()
    helm("dependency", "update", ".", "--skip-refresh", cwd=copy)
    regenerated, committed = (yaml.safe_load((p / "Chart.lock").read_text()) for p in (copy, REPO))
    assert {k: v for k, v in regenerated.items() if k != "generated"} == {k: v for k, v in committed.items() if k != "generated"}


def test_package_contains_the_job_and_renders_the_same(tmp_path):
    helm("package", ".", "--destination", str(tmp_path))
    (package,) = tmp_path.glob("ray-finetune-*.tgz")
    with tarfile.open(package) as tar:
        names = set(tar.getnames())
    assert {f"ray-finetune/{p.relative_to(REPO).as_posix()}" for p in job_files()} <= names
    assert "ray-finetune/charts/raylib/templates/_ray-pod-template.tpl" in names
    assert not any(n.startswith(("ray-finetune/tests/", "ray-finetune/.tools/", "ray-finetune/.venv/")) for n in names)
    args = ("-f", "values/cpu-smoke.yaml")
    assert render(*args, chart=str(package)) == render(*args)
    # Every relative link in the packaged Markdown points into the package, or into docs/, which stays in the
    # source repository (it would not fit the release Secret: docs/chart.md, "Release size").
    with tarfile.open(package) as tar:
        for member in (m for m in tar.getmembers() if m.name.endswith(".md")):
            text = tar.extractfile(member).read().decode()
            for link in re.findall(r"\]\(([^)#\s]+)", text):
                if "://" not in link:
                    target = posixpath.normpath(posixpath.join(posixpath.dirname(member.name), link))
                    in_repository = target.startswith("ray-finetune/docs/") and (REPO / target.split("/", 1)[1]).exists()
                    assert target in names or in_repository, f"{member.name} links {link}, in neither package nor docs/"


def test_ray_pods_get_the_grace_period_for_a_preemption_save():
    for value in (120, 300):
        objects = render("--set", f"terminationGracePeriodSeconds={value}", "--set", "rayCluster.create=true")
        specs = list(ray_pod_specs(objects))
        assert {g for g, _ in specs} == {"head", "workers"}, specs
        for group, spec in specs:
            pod = spec["template"]["spec"]
            assert pod["terminationGracePeriodSeconds"] == value, group
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == str(value - 10), group  # ray start drains within it
            assert env["RAY_JOB_STOP_WAIT_TIME_S"] == str(value - 10), group  # a stopped driver's save within it
    assert "terminationGracePeriodSeconds" in render_error("--set", "terminationGracePeriodSeconds=5")
