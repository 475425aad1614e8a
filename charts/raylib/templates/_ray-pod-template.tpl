{{/*
A pod spec's `imagePullSecrets`: the Ray pods use it, and so may the calling chart's other pods.
Input: a non-empty LocalObjectReference list.
*/}}
{{- define "raylib.imagePullSecrets" -}}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
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
  {{- include "raylib.imagePullSecrets" . | nindent 2 }}
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
  {{- with $pod.terminationGracePeriodSeconds }}
  terminationGracePeriodSeconds: {{ . }}
  {{- end }}
  {{- with $pod.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.initContainers }}
  initContainers:
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
      {{- with $group.securityContext }}
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
