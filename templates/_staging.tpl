{{/*
Data in: the head pod's init container that copies `staging.copies` onto the runs claim and checks that the
run's data sources are readable, before Ray starts (so before the job is submitted). What fails is told at once
(job/driver/staging.py) and ends the run through its driver.
*/}}

{{/* The run's data sources that are files or object-store URIs (JSON map: run.data.<key> -> path). */}}
{{- define "ray-finetune.dataSources" -}}
{{- $data := (include "ray-finetune.runConfig" . | fromYaml).data | default dict }}
{{- $sources := dict }}
{{- range $key := list "train" "validation" }}
{{- $source := index $data $key }}
{{- $path := kindIs "map" $source | ternary (get (kindIs "map" $source | ternary $source dict) "path") $source }}
{{- if and $path (not (hasPrefix "hf:" (toString $path))) (not (hasPrefix "builtin:" (toString $path))) }}
{{- $_ := set $sources (printf "run.data.%s" $key) $path }}
{{- end }}
{{- end }}
{{- toJson $sources }}
{{- end }}

{{/* Python: `missing_data()`, the first data source in $DATA_SOURCES (JSON) that does not exist, in one line naming
the value; None when every one does. */}}
{{- define "ray-finetune.checkDataScript" -}}
import json, os, sys
import pyarrow.fs
def missing_data():
    for field, path in json.loads(os.environ["DATA_SOURCES"]).items():
        fs, inner = pyarrow.fs.FileSystem.from_uri(path if "://" in path else "file://" + os.path.abspath(path))
        if fs.get_file_info(inner).type == pyarrow.fs.FileType.NotFound:
            return f"{field}: {path} does not exist: copy it there (staging.copies) or point {field} at it"
        print(f"{field}: {path} is readable", flush=True)
    return None
{{- end }}

{{/* The staging init container (YAML map), or nothing when there is nothing to copy or check. */}}
{{- define "ray-finetune.stagingContainer" -}}
{{- $copies := .Values.staging.copies }}
{{- $sources := include "ray-finetune.dataSources" . }}
{{- if and $copies (not (include "ray-finetune.claimName" .)) }}
{{- fail "staging.copies: copies go to the runs claim; with storage.uri read the data from the bucket instead" }}
{{- end }}
{{- if or $copies (ne $sources "{}") }}
name: stage-data
image: {{ include "ray-finetune.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
command: ["python", "-c"]
args:
  - |
    # Copies each of $STAGING_COPIES once (a marker beside the copy records its source), then checks the data. A
    # failure is said in one line, recorded in run.json and as an Event on the RayJob (job/driver/staging.py), and
    # the head starts anyway: KubeRay ends a RayJob only through its Ray job, whose driver ends the run with it.
    import subprocess
    def stage():
        for i, copy in enumerate(json.loads(os.environ["STAGING_COPIES"])):
            source, target = copy["from"], os.path.join(os.environ["STAGING_ROOT"], copy["to"])
            marker, origin = target.rstrip("/") + ".staged", json.dumps(copy, sort_keys=True)
            if os.path.exists(marker) and open(marker).read() == origin:
                print(f"{target}: already copied from {source}", flush=True)
                continue
            print(f"copying {source} -> {target}", flush=True)
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                if source.startswith("hf:"):
                    from huggingface_hub import snapshot_download
                    repo = source.removeprefix("hf:")
                    kind = "dataset" if repo.startswith("datasets/") else "model"
                    snapshot_download(repo.removeprefix("datasets/"), repo_type=kind, revision=copy.get("revision"), local_dir=target)
                else:
                    uri = source if "://" in source else "file://" + source
                    fs, inner = pyarrow.fs.FileSystem.from_uri(uri)
                    if fs.get_file_info(inner).type == pyarrow.fs.FileType.Directory:
                        os.makedirs(target, exist_ok=True)  # copy_files creates files, not the directory they go in
                    pyarrow.fs.copy_files(uri, "file://" + target)
            except Exception as e:
                return f"staging.copies[{i}]: cannot copy {source} -> {target}: {type(e).__name__}: {' '.join(str(e).split())[:500]}"
            with open(marker, "w") as f:
                f.write(origin)
        return missing_data()
    {{- include "ray-finetune.checkDataScript" . | nindent 4 }}
    problem = stage()
    if problem:
        print(problem, flush=True)
        subprocess.run([sys.executable, "-m", "job.driver.staging", "--config", os.environ["RUN_CONFIG"], problem])
env:
  {{- include "ray-finetune.env" . | nindent 2 }}
  - name: STAGING_ROOT
    value: {{ .Values.storage.mountPath }}
  - name: STAGING_COPIES
    value: {{ toJson $copies | quote }}
  - name: DATA_SOURCES
    value: {{ $sources | quote }}
  - name: RUN_CONFIG
    value: {{ include "ray-finetune.runConfigPath" . }}
  {{- if not .Values.monitoring.rayJob }}
  - name: JOB_RAYJOB  # the RayJob a failure is told on (an Event); with monitoring.rayJob the env above has it
    value: {{ include "ray-finetune.rayJobName" . }}
  {{- end }}
{{- with .Values.storage.existingSecret }}
envFrom:
  - secretRef:
      name: {{ . }}
{{- end }}
resources:
  requests:
    cpu: {{ .Values.head.cpu | toString | quote }}
    memory: {{ .Values.head.memory }}
  limits:
    cpu: {{ .Values.head.cpu | toString | quote }}
    memory: {{ .Values.head.memory }}
securityContext:
  {{- include "ray-finetune.securityContext" (dict "ctx" . "role" .Values.head.securityContext) | nindent 2 }}
volumeMounts:
  - name: job-code
    mountPath: {{ include "ray-finetune.jobRoot" . }}/job
    readOnly: true
  - name: run-config
    mountPath: {{ include "ray-finetune.runConfigDir" . }}
    readOnly: true
  {{- with include "ray-finetune.claimName" . }}
  - name: runs
    mountPath: {{ $.Values.storage.mountPath }}
  {{- end }}
{{- end }}
{{- end }}
