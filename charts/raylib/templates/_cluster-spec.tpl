{{/*
raylib renders KubeRay ray.io/v1 objects from a plain "cluster description", so that every Ray chart
describes its cluster in its own values and shares one pod template:

  rayVersion: "2.60.0"
  authOptions: {}               # RayClusterSpec authOptions, e.g. {mode: token}; omitted when empty
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
    terminationGracePeriodSeconds: 0  # SIGTERM to SIGKILL, seconds; 0: Kubernetes' default (30)
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
    securityContext: {}         # of the group's Ray container
    initContainers: []          # core/v1 Containers run before Ray starts

The pod template itself is in _ray-pod-template.tpl. Callers build the description (usually as YAML, then `fromYaml`) and include "raylib.clusterSpec".
*/}}

{{/* RayClusterSpec: fixed-size head and worker groups (no autoscaler), all from raylib.podTemplate. */}}
{{- define "raylib.clusterSpec" -}}
rayVersion: {{ .rayVersion | quote }}
enableInTreeAutoscaling: false
{{- with .authOptions }}
authOptions:
  {{- toYaml . | nindent 2 }}
{{- end }}
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
