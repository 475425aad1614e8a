{{/*
raylib renders KubeRay ray.io/v1 objects from a plain "cluster description", so that every Ray chart
describes its cluster in its own values and shares one pod template:

  rayVersion: "2.60.0"
  pod:                          # shared by every Ray pod (head and workers)
    image: repo:tag             # or repo@sha256:...
    imagePullPolicy: IfNotPresent
    imagePullSecrets: []        # [{name: ...}]
    serviceAccountName: ""
    labels: {}                  # pod labels
    annotations: {}             # pod annotations (e.g. checksum/*)
    env: []                     # container EnvVars
    envFrom: []
    volumes: []
    volumeMounts: []
    shmSizeLimit: 8Gi           # memory-backed /dev/shm of this size
    podSecurityContext: {}
    securityContext: {}         # of the Ray container
  head: <group>
  workerGroups:                 # map: group name -> <group> plus `replicas`
    workers: <group>

  <group>:
    valuesPath: head            # where the group is set in the caller's values, for error messages
    labels: {}                  # extra pod labels of this group
    env: []                     # extra EnvVars of this group
    cpu: "4"                    # requests = limits
    memory: 16Gi
    gpus: 0                     # nvidia.com/gpu per pod; also sets rayStartParams num-gpus
    extendedResources: {}       # more requests = limits, e.g. {vpc.amazonaws.com/efa: 1}
    rayStartParams: {}          # must not hold num-gpus (derived from gpus)
    nodeSelector: {}
    tolerations: []
    affinity: {}
    priorityClassName: ""

Callers build the description (usually as YAML, then `fromYaml`) and include "raylib.clusterSpec".
*/}}

{{/* RayClusterSpec: fixed-size head and worker groups (no autoscaler), all from raylib.podTemplate. */}}
{{- define "raylib.clusterSpec" -}}
rayVersion: {{ .rayVersion | quote }}
enableInTreeAutoscaling: false
headGroupSpec:
  rayStartParams:
    {{- include "raylib.rayStartParams" .head | nindent 4 }}
  template:
    {{- include "raylib.podTemplate" (dict "pod" .pod "group" .head "containerName" "ray-head") | nindent 4 }}
workerGroupSpecs:
{{- range $name, $group := .workerGroups }}
  - groupName: {{ $name }}
    replicas: {{ int $group.replicas }}
    minReplicas: {{ int $group.replicas }}
    maxReplicas: {{ int $group.replicas }}
    rayStartParams:
      {{- include "raylib.rayStartParams" $group | nindent 6 }}
    template:
      {{- include "raylib.podTemplate" (dict "pod" $.pod "group" $group "containerName" "ray-worker") | nindent 6 }}
{{- end }}
{{- end }}

{{/* rayStartParams of a group: its own, plus num-gpus derived from its GPU request. */}}
{{- define "raylib.rayStartParams" -}}
{{- $params := deepCopy (.rayStartParams | default dict) -}}
{{- if hasKey $params "num-gpus" -}}
{{- fail (printf "%s.rayStartParams.num-gpus: do not set it; it is derived from %s.gpus" .valuesPath .valuesPath) -}}
{{- end -}}
{{- $_ := set $params "num-gpus" (int (.gpus | default 0) | toString) -}}
{{- range $key, $value := $params }}
{{- $_ := set $params $key (toString $value) }}
{{- end }}
{{- toYaml $params }}
{{- end }}

{{/* The one Ray pod template. Input: dict "pod" <pod> "group" <group> "containerName" <name>. */}}
{{- define "raylib.podTemplate" -}}
{{- $pod := .pod -}}
{{- $group := .group -}}
metadata:
  labels:
    {{- toYaml (merge (deepCopy ($group.labels | default dict)) ($pod.labels | default dict)) | nindent 4 }}
  {{- with $pod.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $pod.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  {{- with $pod.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $pod.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .containerName }}
      image: {{ $pod.image }}
      {{- with $pod.imagePullPolicy }}
      imagePullPolicy: {{ . }}
      {{- end }}
      {{- with concat ($pod.env | default list) ($group.env | default list) }}
      env:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pod.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      resources:
        {{- $resources := include "raylib.resources" $group | fromYaml }}
        requests:
          {{- toYaml $resources | nindent 10 }}
        limits:
          {{- toYaml $resources | nindent 10 }}
      {{- with $pod.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- with $pod.volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $pod.shmSizeLimit }}
    {{- with $pod.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* Resource quantities of a group's Ray container (used as both requests and limits). */}}
{{- define "raylib.resources" -}}
{{- $resources := dict "cpu" (toString .cpu) "memory" (toString .memory) -}}
{{- if gt (int (.gpus | default 0)) 0 -}}
{{- $_ := set $resources "nvidia.com/gpu" (int .gpus) -}}
{{- end -}}
{{- range $name, $quantity := .extendedResources | default dict -}}
{{- $_ := set $resources $name $quantity -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end }}
