{{/*
The run config at render time. values.schema.json checks types, enums and ranges (generated from the job's
dataclasses); what it cannot check is here: numbers Helm's `--set` passes as strings, and the job's
cross-field rules (`job.config.validate`), so `helm install` rejects what the job would reject at start.
tests/test_chart.py compares both on a broad sample of configs.
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
The job's cross-field rules (job.config.validate), on the run config with its defaults filled in; each fails
naming the field as the job does, prefixed with `run.`. Input: dict "ctx" $ "run" <run config with defaults>.
*/}}
{{- define "ray-finetune.checkRun" -}}
{{- $r := .run }}
{{- $m := $r.model }}
{{- $d := $r.data }}
{{- $t := $r.train }}
{{- $e := $r.eval }}
{{- $p := $r.parallel }}
{{- $s := $r.scaling }}
{{- $debug := $r.debug }}
{{- $maxSteps := int $t.max_steps }}
{{- if ge (int $t.warmup_steps) $maxSteps }}
{{- fail (printf "run.train.warmup_steps: %d must be below run.train.max_steps (%d)" (int $t.warmup_steps) $maxSteps) }}
{{- end }}
{{- with .ctx.Values.hardware }}
{{- $tokens := mul (int $t.micro_batch_size) (int $t.seq_len) }}
{{- if and (gt (int .maxTokensPerDevice) 0) (gt $tokens (int .maxTokensPerDevice)) }}
{{- fail (printf "run.train.micro_batch_size: %d x run.train.seq_len %d = %d tokens per device, above the %d that fit hardware profile %s (hardware.maxTokensPerDevice): give the hardware profile last (-f <workload>.yaml -f <hardware>.yaml) so its memory fit wins, or lower run.train.micro_batch_size" (int $t.micro_batch_size) (int $t.seq_len) $tokens (int .maxTokensPerDevice) (.name | default "(unnamed)")) }}
{{- end }}
{{- end }}
{{- if and (eq $m.init "pretrained") (kindIs "invalid" $m.path) }}
{{- fail "run.model.path: required with run.model.init: pretrained (or set run.model.init: random)" }}
{{- end }}
{{- if and (eq $m.init "random") (kindIs "invalid" $m.path) (kindIs "invalid" $m.preset) }}
{{- fail "run.model.preset: run.model.init: random needs an architecture: set run.model.preset or run.model.path" }}
{{- end }}
{{- if and (not (kindIs "invalid" $m.preset)) (not (kindIs "invalid" $m.path)) }}
{{- fail "run.model.preset: give either run.model.preset or run.model.path, not both" }}
{{- end }}
{{- if and (not (kindIs "invalid" $m.sdpa_backend)) (ne $m.attn_implementation "sdpa") }}
{{- fail (printf "run.model.sdpa_backend: needs run.model.attn_implementation: sdpa, not %s" $m.attn_implementation) }}
{{- end }}
{{- if and (not (kindIs "invalid" $m.train_tokenizer_vocab)) (not (kindIs "invalid" $m.tokenizer)) }}
{{- fail "run.model.train_tokenizer_vocab: contradicts run.model.tokenizer: load a tokenizer or train one" }}
{{- end }}
{{- if eq $d.format "synthetic" }}
{{- range $key := list "train" "validation" }}
{{- if not (kindIs "invalid" (index $d $key)) }}
{{- fail (printf "run.data.%s: synthetic data takes no source (set run.data.format: text to train on it)" $key) }}
{{- end }}
{{- end }}
{{- if not (kindIs "invalid" $e.task) }}
{{- fail "run.eval.task: task evaluation needs real data (run.data.format: prompt_completion or chat)" }}
{{- end }}
{{- else }}
{{- if kindIs "invalid" $d.train }}
{{- fail (printf "run.data.train: required with run.data.format: %s (a dataset path in the pods, e.g. under storage.mountPath)" $d.format) }}
{{- end }}
{{- range $key := list "train" "validation" }}
{{- $source := index $d $key }}
{{- if not (kindIs "invalid" $source) }}
{{- $path := ternary $source (get (kindIs "map" $source | ternary $source dict) "path") (kindIs "string" $source) }}
{{- if not $path }}
{{- fail (printf "run.data.%s.path: required (a file, directory, URI or hf:owner/name)" $key) }}
{{- end }}
{{- $hub := and (hasPrefix "hf:" $path) (not (hasPrefix "hf://" $path)) }}
{{- if and $hub (ne (len (splitList "/" $path)) 2) }}
{{- fail (printf "run.data.%s.path: expected hf:owner/name, got %q" $key $path) }}
{{- end }}
{{- if and (not $hub) (kindIs "map" $source) }}
{{- range $option := list "revision" "subset" }}
{{- if not (kindIs "invalid" (index $source $option)) }}
{{- fail (printf "run.data.%s.%s: only for hub sources (hf:owner/name), not %q" $key $option $path) }}
{{- end }}
{{- end }}
{{- if ne $source.split "train" }}
{{- fail (printf "run.data.%s.split: only for hub sources (hf:owner/name), not %q" $key $path) }}
{{- end }}
{{- end }}
{{- if hasPrefix "builtin:" $path }}
{{- if ne $path "builtin:python-docs" }}
{{- fail (printf "run.data.%s.path: unknown builtin source %q (known: builtin:python-docs)" $key $path) }}
{{- end }}
{{- if ne $d.format "text" }}
{{- fail (printf "run.data.%s.path: builtin:python-docs is plain text, for run.data.format: text only" $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq $d.format "prompt_completion" }}
{{- /* Python's str.format fields: {name}, {name!r}, {name:spec}; {{ and }} are literal braces. */}}
{{- $fields := $d.prompt_template | replace "{{" "" | replace "}}" "" }}
{{- if not (regexMatch "^([^{}]|\\{[A-Za-z_][A-Za-z0-9_]*(![^:{}])?(:([^{}]|\\{[^{}]*\\})*)?\\})*$" $fields) }}
{{- fail (printf "run.data.prompt_template: fields must be column names like {prompt}, got %q" $d.prompt_template) }}
{{- end }}
{{- end }}
{{- if and (not (kindIs "invalid" $d.chat_template)) (ne $d.format "chat") }}
{{- fail "run.data.chat_template: only used with run.data.format: chat" }}
{{- end }}
{{- if and (kindIs "invalid" $d.validation) (eq (float64 $d.validation_fraction) 0.0) (kindIs "invalid" $e.task) }}
{{- /* (the job's tree order: checkpoint before eval; with run.eval.task, its own rule below says it) */}}
{{- $noHeldout := "needs held-out data: set run.data.validation or run.data.validation_fraction > 0" }}
{{- if $r.checkpoint.export }}
{{- fail (printf "run.checkpoint.export: the export's acceptance check (its held-out loss against the final evaluation's) %s, or set run.checkpoint.export: false" $noHeldout) }}
{{- end }}
{{- if gt (int $e.every_steps) 0 }}
{{- fail (printf "run.eval.every_steps: evaluation %s" $noHeldout) }}
{{- end }}
{{- end }}
{{- if not (kindIs "invalid" $e.task) }}
{{- if not (has $d.format (list "prompt_completion" "chat")) }}
{{- fail (printf "run.eval.task: needs run.data.format prompt_completion or chat, not %s" $d.format) }}
{{- end }}
{{- if and (kindIs "invalid" $d.validation) (eq (float64 $d.validation_fraction) 0.0) }}
{{- fail "run.eval.task: needs held-out rows: set run.data.validation or run.data.validation_fraction > 0" }}
{{- end }}
{{- end }}
{{- if and (kindIs "invalid" $m.tokenizer) (kindIs "invalid" $m.path) (kindIs "invalid" $m.train_tokenizer_vocab) }}
{{- fail "run.model.tokenizer: real data needs a tokenizer: set run.model.tokenizer, run.model.path or run.model.train_tokenizer_vocab" }}
{{- end }}
{{- end }}
{{- $group := int $p.shard_group_size }}
{{- if and $group (mod (int $s.num_workers) $group) }}
{{- fail (printf "run.parallel.shard_group_size: %d must be 0 or divide run.scaling.num_workers (%d, from the worker groups)" $group (int $s.num_workers)) }}
{{- end }}
{{- if and $p.cpu_offload $p.compile }}
{{- fail "run.parallel.compile: not supported together with run.parallel.cpu_offload" }}
{{- end }}
{{- if and (eq $p.mixed_precision "bf16") (not $s.use_gpu) }}
{{- fail "run.parallel.mixed_precision: bf16 needs GPU workers (CPU runs use fp32)" }}
{{- end }}
{{- if and (ne $p.float8 "none") (not $s.use_gpu) }}
{{- fail (printf "run.parallel.float8: %s needs GPU workers (float8 GEMMs run on CUDA GPUs of compute capability >= 8.9)" $p.float8) }}
{{- else if and (ne $p.float8 "none") (eq $p.mixed_precision "fp32") }}
{{- fail (printf "run.parallel.float8: %s needs bf16 compute (run.parallel.mixed_precision: auto or bf16), not fp32" $p.float8) }}
{{- end }}
{{- $lora := $m.lora }}
{{- if and (kindIs "invalid" $lora.rank) $lora.merged_export }}
{{- fail "run.model.lora.merged_export: merges adapters, and run.model.lora.rank is null (a full fine-tune, whose export is already full weights)" }}
{{- else if and (not (kindIs "invalid" $lora.rank)) (ne $p.float8 "none") }}
{{- fail (printf "run.model.lora.rank: LoRA does not run with run.parallel.float8: %s; set run.parallel.float8: none or run.model.lora.rank: null" $p.float8) }}
{{- end }}
{{- if and $lora.merged_export (not $r.checkpoint.export) }}
{{- fail "run.model.lora.merged_export: needs run.checkpoint.export: true (the merged weights are part of the export)" }}
{{- end }}
{{- range $key := list "fail_at_step" "profile_step" }}
{{- $step := index $debug $key }}
{{- if and (not (kindIs "invalid" $step)) (gt (int $step) $maxSteps) }}
{{- fail (printf "run.debug.%s: must be within [1, run.train.max_steps=%d], got %d" $key $maxSteps (int $step)) }}
{{- end }}
{{- end }}
{{- if ge (int $debug.fail_rank) (int $s.num_workers) }}
{{- fail (printf "run.debug.fail_rank: must be within [0, run.scaling.num_workers=%d), got %d" (int $s.num_workers) (int $debug.fail_rank)) }}
{{- end }}
{{- $spikeFactor := float64 $t.loss_spike_factor }}
{{- if and (ne $spikeFactor 0.0) (le $spikeFactor 1.0) }}
{{- fail (printf "run.train.loss_spike_factor: must be 0 (off) or > 1, got %v" $t.loss_spike_factor) }}
{{- end }}
{{- if not (kindIs "invalid" $debug.fail_at_step) }}
{{- $hangOff := and (not (kindIs "invalid" $t.hang_timeout_s)) (eq (float64 $t.hang_timeout_s) 0.0) }}
{{- if and (eq $debug.fail_mode "hang") $hangOff }}
{{- fail "run.debug.fail_mode: hang needs its check on: run.train.hang_timeout_s is 0" }}
{{- else if and (eq $debug.fail_mode "loss_spike") (eq $spikeFactor 0.0) }}
{{- fail "run.debug.fail_mode: loss_spike needs its check on: run.train.loss_spike_factor is 0" }}
{{- end }}
{{- end }}
{{- if and (not (kindIs "invalid" $e.sample_prompt)) (eq $d.format "synthetic") }}
{{- fail "run.eval.sample_prompt: synthetic data has no tokenizer to encode a prompt" }}
{{- end }}
{{- $every := int $r.checkpoint.every_steps }}
{{- if gt $every $maxSteps }}
{{- fail (printf "run.checkpoint.every_steps: %d is longer than the run (run.train.max_steps %d), so no checkpoint would come before the last step; set it to at most run.train.max_steps, or 0 to save only at the end" $every $maxSteps) }}
{{- end }}
{{- end }}
