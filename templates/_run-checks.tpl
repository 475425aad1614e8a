{{/*
The run config at render time. values.schema.json checks types, enums and ranges (generated from the job's
dataclasses); what it cannot check is here: numbers Helm's `--set` passes as strings, and the job's rules across
fields (`job.rules`, compiled into _run-rules.tpl), so `helm install` rejects what the job would reject at start,
with the same message. tests/test_chart.py compares both on a broad sample of configs.
*/}}

{{/*
A number field's value given as a string ("2e-5", from `--set`), as a number checked against the schema's
bounds (which JSON Schema applies to numbers only); empty for anything else.
Input: dict "value" <value> "schema" <field schema> "path" <dotted path>.
*/}}
{{- define "ray-finetune.number" -}}
{{- $types := .schema.type | default list }}
{{- if kindIs "string" $types }}{{ $types = list $types }}{{ end }}
{{- if and (kindIs "string" .value) (has "number" $types) }}
{{- $n := float64 .value }}
{{- with .schema }}
{{- if and (hasKey . "minimum") (lt $n (float64 .minimum)) }}{{ fail (printf "%s: must be >= %v, got %s" $.path .minimum $.value) }}{{ end }}
{{- if and (hasKey . "exclusiveMinimum") (le $n (float64 .exclusiveMinimum)) }}{{ fail (printf "%s: must be > %v, got %s" $.path .exclusiveMinimum $.value) }}{{ end }}
{{- if and (hasKey . "maximum") (gt $n (float64 .maximum)) }}{{ fail (printf "%s: must be <= %v, got %s" $.path .maximum $.value) }}{{ end }}
{{- if and (hasKey . "exclusiveMaximum") (ge $n (float64 .exclusiveMaximum)) }}{{ fail (printf "%s: must be < %v, got %s" $.path .exclusiveMaximum $.value) }}{{ end }}
{{- end }}
{{- $n }}
{{- end }}
{{- end }}

{{/* The object branch of a field schema (a source is a string or an object), else the schema itself. */}}
{{- define "ray-finetune.objectSchema" -}}
{{- $schema := . }}
{{- range .anyOf | default list }}{{ if .properties }}{{ $schema = . }}{{ end }}{{ end }}
{{- toJson $schema }}
{{- end }}

{{/* Turns number strings into numbers, in place. Input: dict "node" <map> "schema" <object schema> "path" <path>. */}}
{{- define "ray-finetune.runNumbers" -}}
{{- $properties := .schema.properties | default dict }}
{{- range $key, $value := .node }}
{{- $schema := include "ray-finetune.objectSchema" (index $properties $key | default dict) | fromJson }}
{{- $path := printf "%s.%s" $.path $key }}
{{- if kindIs "map" $value }}
{{- include "ray-finetune.runNumbers" (dict "node" $value "schema" $schema "path" $path) }}
{{- else if kindIs "slice" $value }}
{{- $items := list }}
{{- range $i, $item := $value }}
{{- $number := include "ray-finetune.number" (dict "value" $item "schema" ($schema.items | default dict) "path" (printf "%s[%d]" $path $i)) }}
{{- $items = append $items (ternary (float64 $number) $item (ne $number "")) }}
{{- end }}
{{- $_ := set $.node $key $items }}
{{- else }}
{{- with include "ray-finetune.number" (dict "value" $value "schema" $schema "path" $path) }}
{{- $_ := set $.node $key (float64 .) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Fills in the job's defaults (the schema's `default`s), in place. Input: dict "node" <map> "schema" <object schema>. */}}
{{- define "ray-finetune.withDefaults" -}}
{{- $node := .node }}
{{- range $key, $field := .schema.properties }}
{{- $schema := include "ray-finetune.objectSchema" $field | fromJson }}
{{- if not (hasKey $node $key) }}
{{- if hasKey $field "default" }}{{ $_ := set $node $key $field.default }}{{ else if $field.properties }}{{ $_ := set $node $key dict }}{{ end }}
{{- end }}
{{- if and (kindIs "map" (index $node $key)) $schema.properties }}
{{- include "ray-finetune.withDefaults" (dict "node" (index $node $key) "schema" $schema) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The chart's own rule (the hardware profile's memory fit), then the job's rules across fields (`job.rules.RULES`,
compiled into ray-finetune.runRules by scripts/gen-values-schema.py), on the run config with its defaults filled
in. Input: dict "ctx" $ "run" <run config with defaults>.
*/}}
{{- define "ray-finetune.checkRun" -}}
{{- $t := .run.train }}
{{- with .ctx.Values.hardware }}
{{- $tokens := mul (int $t.micro_batch_size) (int $t.seq_len) }}
{{- if and (gt (int .maxTokensPerDevice) 0) (gt $tokens (int .maxTokensPerDevice)) }}
{{- fail (printf "run.train.micro_batch_size: %d x run.train.seq_len %d = %d tokens per device, above the %d that fit hardware profile %s (hardware.maxTokensPerDevice): give the hardware profile last (-f <workload>.yaml -f <hardware>.yaml) so its memory fit wins, or lower run.train.micro_batch_size" (int $t.micro_batch_size) (int $t.seq_len) $tokens (int .maxTokensPerDevice) (.name | default "(unnamed)")) }}
{{- end }}
{{- end }}
{{- include "ray-finetune.runRules" .run }}
{{- end }}
