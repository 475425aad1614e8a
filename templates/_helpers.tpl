{{/* Chart name, overridable. */}}
{{- define "ray-finetune.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Object name prefix. Truncated to 38 characters: the RayJob appends "-" and an 8-character content hash and
KubeRay caps RayJob names at 47 (its RayCluster, Services and Pods derive their names from it).
*/}}
{{- define "ray-finetune.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 38 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 38 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 38 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart label value. */}}
{{- define "ray-finetune.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels: the chart's, then commonLabels. */}}
{{- define "ray-finetune.labels" -}}
helm.sh/chart: {{ include "ray-finetune.chart" . }}
{{ include "ray-finetune.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
metadata of every object: name, the release namespace, common labels and annotations plus the object's own.
Input: dict "ctx" $ "name" <name> [ "labels" <map> ] [ "annotations" <map> ].
*/}}
{{- define "ray-finetune.metadata" -}}
{{- $ctx := .ctx -}}
name: {{ .name }}
namespace: {{ $ctx.Release.Namespace }}
labels:
  {{- include "ray-finetune.labels" $ctx | nindent 2 }}
  {{- with .labels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with merge (deepCopy (.annotations | default dict)) $ctx.Values.commonAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Labels of every pod: selector labels, commonLabels, podLabels. */}}
{{- define "ray-finetune.podLabels" -}}
{{ include "ray-finetune.selectorLabels" . }}
{{- with merge (deepCopy .Values.podLabels) .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels. */}}
{{- define "ray-finetune.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ray-finetune.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* imagePullSecrets of every pod, as a LocalObjectReference list (JSON): rendered by raylib.imagePullSecrets. */}}
{{- define "ray-finetune.imagePullSecrets" -}}
{{- $references := list }}
{{- range .Values.imagePullSecrets }}
{{- $references = append $references (dict "name" .) }}
{{- end }}
{{- toJson $references }}
{{- end }}

{{/*
A container security context: `securityContext` with a role's own merged over it, plus capabilities to add.
Input: dict "ctx" $ "role" <map> [ "add" <list> ].
*/}}
{{- define "ray-finetune.securityContext" -}}
{{- $context := mergeOverwrite (deepCopy .ctx.Values.securityContext) (deepCopy (.role | default dict)) }}
{{- with .add }}
{{- $capabilities := $context.capabilities | default dict }}
{{- $_ := set $capabilities "add" (concat ($capabilities.add | default list) . | uniq) }}
{{- $_ := set $context "capabilities" $capabilities }}
{{- end }}
{{- toYaml $context }}
{{- end }}

{{/*
Spec of the pods that are not Ray nodes (job submitter, helm test): one container from the chart's image, with
the pod and role security contexts. Input: dict "ctx" $ "container" <map without image> "securityContext" <role
map> [ "volumes" <list> ] [ "serviceAccount" true ].
*/}}
{{- define "ray-finetune.auxPodSpec" -}}
{{- $ctx := .ctx -}}
{{- $container := merge (deepCopy .container) (dict
      "image" (include "ray-finetune.image" $ctx)
      "imagePullPolicy" $ctx.Values.image.pullPolicy
      "securityContext" (include "ray-finetune.securityContext" (dict "ctx" $ctx "role" .securityContext) | fromYaml)) -}}
restartPolicy: Never
{{- if .serviceAccount }}
serviceAccountName: {{ include "ray-finetune.fullname" $ctx }}
{{- else }}
automountServiceAccountToken: false
{{- end }}
{{- with include "ray-finetune.imagePullSecrets" $ctx | fromJsonArray }}
{{ include "raylib.imagePullSecrets" . }}
{{- end }}
securityContext:
  {{- toYaml $ctx.Values.podSecurityContext | nindent 2 }}
containers:
  {{- toYaml (list $container) | nindent 2 }}
{{- with .volumes }}
volumes:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Image reference: repository@digest when a digest is given, else repository:tag. */}}
{{- define "ray-finetune.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}
{{- end }}

{{/*
The job package's files (job/**), a tree: a ConfigMap key cannot hold "/", so each file's key is its path in the
package with "/" spelled "-" (unambiguous: a Python module name has no "-"), and the volume's items
(ray-finetune.jobItems) put each key back at its path.
*/}}
{{- define "ray-finetune.jobPaths" -}}
{{- $paths := list }}
{{- range $path, $_ := .Files.Glob "job/**" }}
{{- $paths = append $paths (trimPrefix "job/" $path) }}
{{- end }}
{{- if not $paths }}
{{- fail "the chart has no job/ package files: package the chart from the repository root" }}
{{- end }}
{{- toJson $paths }}
{{- end }}

{{- define "ray-finetune.jobKey" -}}{{ replace "/" "-" . }}{{- end }}

{{/* The job ConfigMap's data: each file's text under its key. */}}
{{- define "ray-finetune.jobFiles" -}}
{{- $data := dict }}
{{- range include "ray-finetune.jobPaths" . | fromJsonArray }}
{{- $_ := set $data (include "ray-finetune.jobKey" .) ($.Files.Get (printf "job/%s" .)) }}
{{- end }}
{{- toYaml $data }}
{{- end }}

{{/* The job volume's items: each key mounted at its path in the package. */}}
{{- define "ray-finetune.jobItems" -}}
{{- range include "ray-finetune.jobPaths" . | fromJsonArray }}
- key: {{ include "ray-finetune.jobKey" . }}
  path: {{ . }}
{{- end }}
{{- end }}

{{/* Mount points in every Ray pod: the job package at <jobRoot>/job (on PYTHONPATH), the run config file. */}}
{{- define "ray-finetune.jobRoot" -}}/opt/job{{- end }}
{{- define "ray-finetune.runConfigDir" -}}/etc/job{{- end }}
{{- define "ray-finetune.runConfigPath" -}}{{ include "ray-finetune.runConfigDir" . }}/run.yaml{{- end }}

{{/*
RayJob name: the name prefix plus a hash of the values and the job code. A `helm upgrade` that changes
either replaces the RayJob (KubeRay does not re-run an updated RayJob); the run name stays, so the new
RayJob resumes the same run from its latest checkpoint.
*/}}
{{- define "ray-finetune.rayJobName" -}}
{{- $content := printf "%s\n%s" (toYaml .Values) (include "ray-finetune.jobFiles" .) }}
{{- printf "%s-%s" (include "ray-finetune.fullname" .) ($content | sha256sum | trunc 8) }}
{{- end }}

{{/* Name of the `helm test` Pod (the Role lets it patch only itself). */}}
{{- define "ray-finetune.testPodName" -}}
{{- include "ray-finetune.fullname" . }}-test
{{- end }}

{{/* Name of the run: run.name, else the release name. */}}
{{- define "ray-finetune.runName" -}}
{{- .Values.run.name | default .Release.Name }}
{{- end }}

{{/* Name of the runs PersistentVolumeClaim, or empty when runs go to an object store. */}}
{{- define "ray-finetune.claimName" -}}
{{- $storage := .Values.storage }}
{{- if and $storage.uri $storage.existingClaim }}
{{- fail "storage.uri and storage.existingClaim are mutually exclusive: runs go either to an object store or to a volume" }}
{{- end }}
{{- if $storage.existingClaim }}
{{- $storage.existingClaim }}
{{- else if not $storage.uri }}
{{- include "ray-finetune.fullname" . }}-runs
{{- end }}
{{- end }}

{{/* run.storage_path: the object-store URI, or the claim's mount path. */}}
{{- define "ray-finetune.storagePath" -}}
{{- if include "ray-finetune.claimName" . }}
{{- .Values.storage.mountPath }}
{{- else }}
{{- .Values.storage.uri }}
{{- end }}
{{- end }}

{{/* CPU quantity ("4", 4, "500m") as a number of cores. */}}
{{- define "ray-finetune.cpuCores" -}}
{{- $cpu := toString . }}
{{- if hasSuffix "m" $cpu }}
{{- divf (trimSuffix "m" $cpu | float64) 1000 }}
{{- else }}
{{- float64 $cpu }}
{{- end }}
{{- end }}

{{/*
The worker groups (YAML map): each of `workerGroups` over `worker`, or one group `workers` of `worker` when
`workerGroups` is empty. An extra group name therefore never keeps a default group beside it.
*/}}
{{- define "ray-finetune.workerGroups" -}}
{{- $groups := dict }}
{{- range $name, $group := .Values.workerGroups | default (dict "workers" dict) }}
{{- $_ := set $groups $name (mergeOverwrite (deepCopy $.Values.worker) (deepCopy ($group | default dict))) }}
{{- end }}
{{- toYaml $groups }}
{{- end }}

{{/*
run.scaling values derived from the worker groups (YAML): with GPUs one training worker per GPU, without one
per pod; each worker reserves the smallest cpu / gpus (or cpu) of any group, so it fits on every group.
*/}}
{{- define "ray-finetune.derivedScaling" -}}
{{- $groups := include "ray-finetune.workerGroups" . | fromYaml }}
{{- $useGpu := false }}
{{- range $name, $group := $groups }}
{{- if gt (int $group.gpus) 0 }}{{ $useGpu = true }}{{ end }}
{{- end }}
{{- $numWorkers := 0 }}
{{- $cpusPerWorker := -1.0 }}
{{- range $name, $group := $groups }}
{{- if ne (gt (int $group.gpus) 0) $useGpu }}
{{- fail (printf "workerGroups.%s.gpus: %d, but other worker groups %s GPUs: training workers must be alike (all GPU or all CPU)" $name (int $group.gpus) (ternary "have" "have no" $useGpu)) }}
{{- end }}
{{- $perPod := ternary (int $group.gpus) 1 $useGpu }}
{{- $numWorkers = add $numWorkers (mul (int $group.replicas) $perPod) }}
{{- $cpus := divf (include "ray-finetune.cpuCores" $group.cpu) $perPod }}
{{- if or (lt $cpusPerWorker 0.0) (lt $cpus $cpusPerWorker) }}{{ $cpusPerWorker = $cpus }}{{ end }}
{{- end }}
num_workers: {{ $numWorkers }}
use_gpu: {{ $useGpu }}
cpus_per_worker: {{ $cpusPerWorker }}
{{- end }}

{{/*
The run config (YAML): .Values.run with numbers given as strings (`--set run.train.lr=2e-5`) made numbers,
plus what the chart derives. A value the user set that contradicts a derived one fails, naming both; so does
anything else the job would reject (ray-finetune.checkRun).
*/}}
{{- define "ray-finetune.runConfig" -}}
{{- $run := deepCopy .Values.run }}
{{- $schema := include "ray-finetune.runSchema" . | fromJson }}
{{- include "ray-finetune.runNumbers" (dict "node" $run "schema" $schema "path" "run") }}
{{- $_ := set $run "name" (include "ray-finetune.runName" .) }}
{{- $storagePath := include "ray-finetune.storagePath" . }}
{{- if and (hasKey $run "storage_path") (ne (toString $run.storage_path) $storagePath) }}
{{- fail (printf "run.storage_path: %q contradicts the storage values (%q): set storage.uri, storage.existingClaim or storage.mountPath instead" (toString $run.storage_path) $storagePath) }}
{{- end }}
{{- $_ := set $run "storage_path" $storagePath }}
{{- $scaling := $run.scaling | default dict }}
{{- range $key, $derived := include "ray-finetune.derivedScaling" . | fromYaml }}
{{- if and (hasKey $scaling $key) (ne (toString (index $scaling $key)) (toString $derived)) }}
{{- fail (printf "run.scaling.%s: %v contradicts the worker groups, which give %v: change workerGroups (replicas, gpus, cpu) or drop run.scaling.%s" $key (index $scaling $key) $derived $key) }}
{{- end }}
{{- $_ := set $scaling $key $derived }}
{{- end }}
{{- $_ := set $run "scaling" $scaling }}
{{- $effective := deepCopy $run }}
{{- include "ray-finetune.withDefaults" (dict "node" $effective "schema" $schema) }}
{{- include "ray-finetune.checkRun" (dict "ctx" . "run" $effective) }}
{{- /* Go writes small floats as 2e-05, which YAML 1.1 readers (PyYAML) take for a string: write 2.0e-05. */}}
{{- regexReplaceAll "(?m)^(\\s*(?:[\\w.-]+:|-)\\s+-?)([0-9]+)e([-+]?[0-9]+)$" (toYaml $run) "${1}${2}.0e${3}" }}
{{- end }}

{{/* Environment of every Ray container (EnvVar list, YAML). */}}
{{- define "ray-finetune.env" -}}
- name: PYTHONPATH
  value: {{ include "ray-finetune.jobRoot" . }}
- name: JOB_CHART
  value: {{ .Chart.Name }}
- name: JOB_CHART_VERSION
  value: {{ .Chart.Version | quote }}
- name: JOB_RELEASE
  value: {{ .Release.Name }}
- name: JOB_VALUES_SHA256
  value: {{ toYaml .Values | sha256sum }}
- name: JOB_IMAGE
  value: {{ include "ray-finetune.image" . }}
- name: RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S  # `ray start`'s drain on SIGTERM, within the pod's grace period
  value: {{ sub .Values.terminationGracePeriodSeconds 10 | quote }}
- name: RAY_JOB_STOP_WAIT_TIME_S  # `ray job stop` (the RayJob deleted) SIGKILLs the driver after it: its save fits
  value: {{ sub .Values.terminationGracePeriodSeconds 10 | quote }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- if .Values.monitoring.rayJob }}
- name: JOB_RAYJOB  # the RayJob the driver keeps annotated and tells Events on (job/driver/follow.py)
  value: {{ include "ray-finetune.rayJobName" . }}
{{- end }}
{{- with .Values.huggingface.existingSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.huggingface.tokenKey }}
{{- end }}
{{- if .Values.efa.enabled }}
{{- range $name, $value := .Values.efa.env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Description of the Ray cluster for the raylib library (YAML, see charts/raylib). */}}
{{- define "ray-finetune.cluster" -}}
{{- if and .Values.efa.enabled (lt (int .Values.efa.devicesPerPod) 1) }}
{{- fail "efa.devicesPerPod: must be >= 1 when efa.enabled is true (EFA on with no EFA devices)" }}
{{- end }}
{{- if and .Values.rayAuth (semverCompare "<2.52.0-0" .Values.rayVersion) }}
{{- fail (printf "rayAuth: Ray token authentication needs Ray >= 2.52, rayVersion is %s: set rayAuth=false or use a newer image" .Values.rayVersion) }}
{{- end }}
{{- $claimName := include "ray-finetune.claimName" . }}
rayVersion: {{ .Values.rayVersion | quote }}
{{- if .Values.rayAuth }}
authOptions:
  mode: token
{{- end }}
pod:
  image: {{ include "ray-finetune.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  imagePullSecrets: {{ include "ray-finetune.imagePullSecrets" . }}
  serviceAccountName: {{ include "ray-finetune.fullname" . }}
  labels:
    {{- include "ray-finetune.podLabels" . | nindent 4 }}
  annotations:
    checksum/job: {{ include "ray-finetune.jobFiles" . | sha256sum }}
    checksum/config: {{ include "ray-finetune.runConfig" . | sha256sum }}
    {{- with merge (deepCopy .Values.podAnnotations) .Values.commonAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  env:
    {{- include "ray-finetune.env" . | nindent 4 }}
  {{- with .Values.storage.existingSecret }}
  envFrom:
    - secretRef:
        name: {{ . }}
  {{- end }}
  volumes:
    - name: job-code
      configMap:
        name: {{ include "ray-finetune.fullname" . }}-job
        items:
          {{- include "ray-finetune.jobItems" . | nindent 10 }}
    - name: run-config
      configMap:
        name: {{ include "ray-finetune.fullname" . }}-run
    {{- with $claimName }}
    - name: runs
      persistentVolumeClaim:
        claimName: {{ . }}
    {{- end }}
  volumeMounts:
    - name: job-code
      mountPath: {{ include "ray-finetune.jobRoot" . }}/job
      readOnly: true
    - name: run-config
      mountPath: {{ include "ray-finetune.runConfigDir" . }}
      readOnly: true
    {{- if $claimName }}
    - name: runs
      mountPath: {{ .Values.storage.mountPath }}
    {{- end }}
  shmSizeLimit: {{ .Values.shm.sizeLimit }}
  terminationGracePeriodSeconds: {{ int .Values.terminationGracePeriodSeconds }}
  podSecurityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
head:
  valuesPath: head
  labels:
    app.kubernetes.io/component: ray-head
  {{- toYaml (omit .Values.head "securityContext") | nindent 2 }}
  securityContext:
    {{- include "ray-finetune.securityContext" (dict "ctx" . "role" .Values.head.securityContext) | nindent 4 }}
  {{- with include "ray-finetune.stagingContainer" . }}
  initContainers:
    - {{- . | nindent 6 }}
  {{- end }}
workerGroups:
  {{- range $name, $group := include "ray-finetune.workerGroups" . | fromYaml }}
  {{- $efa := and $.Values.efa.enabled (gt (int $group.gpus) 0) }}
  {{ $name }}:
    valuesPath: workerGroups.{{ $name }}
    labels:
      app.kubernetes.io/component: ray-worker
    {{- toYaml (omit $group "securityContext") | nindent 4 }}
    securityContext:
      {{- include "ray-finetune.securityContext" (dict "ctx" $ "role" $group.securityContext "add" (ternary (list "IPC_LOCK") list $efa)) | nindent 6 }}
    {{- if $.Values.efa.enabled }}
    extendedResources:
      vpc.amazonaws.com/efa: {{ int $.Values.efa.devicesPerPod }}
    {{- end }}
  {{- end }}
{{- end }}

{{/*
The job's Ray runtime env: `runtimeEnv`, plus what a feature asked for needs and the image lacks, each unless the
pip list names that package already: the MLflow client when `run.logging.mlflow.tracking_uri` is set, torchao when
`run.model.lora.quantize_base` is (QLoRA's NF4 tensor); the pins are job/packages.py's MLFLOW_VERSION and
TORCHAO_VERSION. The run record lists what it installed (run.json `runtime_env.requirements`). Empty: no runtime env.
*/}}
{{- define "ray-finetune.runtimeEnv" -}}
{{- $env := deepCopy .Values.runtimeEnv }}
{{- $needed := list }}
{{- if ((.Values.run.logging).mlflow).tracking_uri }}{{ $needed = append $needed (list "mlflow" "mlflow-skinny==3.17.2") }}{{ end }}
{{- if ((.Values.run.model).lora).quantize_base }}{{ $needed = append $needed (list "torchao" "torchao==0.18.0") }}{{ end }}
{{- range $needed }}
{{- $prefix := index . 0 }}
{{- $pin := index . 1 }}
{{- $pip := $env.pip | default list }}
{{- $list := kindIs "map" $pip | ternary (get (kindIs "map" $pip | ternary $pip dict) "packages") $pip | default list }}
{{- $named := false }}
{{- range $list }}{{ if hasPrefix $prefix (toString .) }}{{ $named = true }}{{ end }}{{ end }}
{{- if not $named }}
{{- $list = append $list $pin }}
{{- if kindIs "map" $pip }}{{ $_ := set $pip "packages" $list }}{{ else }}{{ $_ := set $env "pip" $list }}{{ end }}
{{- end }}
{{- end }}
{{- if $env }}{{ toYaml $env }}{{ end }}
{{- end }}
