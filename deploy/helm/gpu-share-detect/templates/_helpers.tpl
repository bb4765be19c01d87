{{/* Names and labels. */}}
{{- define "detect.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "detect.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "detect.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "detect.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "detect.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "detect.selectorLabels" . }}
{{- end -}}

{{- define "detect.selectorLabels" -}}
app.kubernetes.io/name: {{ include "detect.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of one group's objects: the chart's, and the group as the component. */}}
{{- define "detect.groupLabels" -}}
{{ include "detect.labels" .root }}
app.kubernetes.io/component: {{ .g.name }}
{{- end -}}

{{- define "detect.groupSelectorLabels" -}}
{{ include "detect.selectorLabels" .root }}
app.kubernetes.io/component: {{ .g.name }}
{{- end -}}

{{- define "detect.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/*
The cap in MiB that a gpu_memory value sets on a GPU of `memoryMiB`, as the service's memory policy
reads it: "4GiB", "4096MiB", "4096", "25%" (of the GPU's memory), or the words growth and greedy.
Arguments: spec, memoryMiB, where (who asks, for the message).
*/}}
{{- define "detect.capMiB" -}}
{{- $raw := toString .spec | trim -}}
{{- $word := lower $raw -}}
{{- $number := "^[0-9]+(\\.[0-9]+)?" -}}
{{- if or (eq $word "growth") (eq $word "greedy") -}}
{{- $word -}}
{{- else if regexMatch (printf "%s\\s*%%$" $number) $raw -}}
{{- $percent := regexFind $number $raw | float64 -}}
{{- if or (le $percent 0.0) (gt $percent 100.0) -}}
{{- fail (printf "%s: gpu_memory %q: a share must be above 0%% and at most 100%%" .where $raw) -}}
{{- end -}}
{{- max 1 (floor (divf (mulf (float64 .memoryMiB) $percent) 100) | int) -}}
{{- else if regexMatch (printf "(?i)%s\\s*(mib|gib|m|g)?$" $number) $raw -}}
{{- $mib := regexFind $number $raw | float64 -}}
{{- if regexMatch "(?i)(gib|g)$" $raw -}}
{{- $mib = mulf $mib 1024 -}}
{{- end -}}
{{- if or (ne (floor $mib) $mib) (le $mib 0.0) -}}
{{- fail (printf "%s: gpu_memory %q: a cap must be a whole number of MiB above 0" .where $raw) -}}
{{- end -}}
{{- int $mib -}}
{{- else -}}
{{- fail (printf "%s: gpu_memory %q: expected 'greedy', 'growth', a size in MiB ('4096', '4096MiB', '4GiB') or a share ('25%%')" .where $raw) -}}
{{- end -}}
{{- end -}}

{{/*
One group, resolved: its gpu, settings, resources, podDisruptionBudget and autoscaling merged over the
chart's, and its budget checked. `helm template` fails here, naming the numbers, when the caps plus the
overhead of replicasPerGpu pods do not fit one GPU (or MIG slice). Returns JSON.
Arguments: root (the chart's context), name, group.
*/}}
{{- define "detect.group" -}}
{{- $root := .root -}}
{{- $name := .name -}}
{{- $group := .group -}}
{{- $gpu := mergeOverwrite (deepCopy $root.Values.gpu) (deepCopy (default dict $group.gpu)) -}}
{{- $settings := mergeOverwrite (deepCopy (default dict $root.Values.settings)) (deepCopy (default dict $group.settings)) -}}
{{- $resources := mergeOverwrite (deepCopy $root.Values.resources) (deepCopy (default dict $group.resources)) -}}
{{- $pdb := mergeOverwrite (deepCopy $root.Values.podDisruptionBudget) (deepCopy (default dict $group.podDisruptionBudget)) -}}
{{- $autoscaling := mergeOverwrite (deepCopy $root.Values.autoscaling) (deepCopy (default dict $group.autoscaling)) -}}
{{- range $key := list "host" "port" "grpc_port" "model" "model_repository" "gpu_total_mib" "gpu_overhead_mib" "gpus" -}}
{{- if hasKey $settings $key -}}
{{- fail (printf "group %q: settings.%s is set by the chart (from service.port and grpcPort, the group's models and modelRepository, and gpu)" $name $key) -}}
{{- end -}}
{{- end -}}
{{- $memory := int $gpu.memoryMiB -}}
{{- $perGpu := int $gpu.replicasPerGpu -}}
{{- $overhead := int $gpu.overheadMiB -}}
{{- $models := $group.models -}}
{{- $podMiB := 0 -}}
{{- $terms := list -}}
{{- $unbounded := list -}}
{{- $greedy := list -}}
{{- range $model, $table := $models -}}
{{- $where := printf "group %q, model %q" $name $model -}}
{{- $cap := include "detect.capMiB" (dict "spec" $table.gpu_memory "memoryMiB" $memory "where" $where) -}}
{{- if eq $cap "greedy" -}}
{{- $greedy = append $greedy $model -}}
{{- else if eq $cap "growth" -}}
{{- $unbounded = append $unbounded $model -}}
{{- $podMiB = add $podMiB $overhead -}}
{{- $terms = append $terms (printf "%s growth (no cap)" $model) -}}
{{- else -}}
{{- $podMiB = add $podMiB (int $cap) $overhead -}}
{{- $terms = append $terms (printf "%s %s MiB" $model $cap) -}}
{{- end -}}
{{- end -}}
{{- if and $greedy (or (gt $perGpu 1) (gt (len $models) 1)) -}}
{{- $others := ternary (printf "%d pods may share its GPU (gpu.replicasPerGpu)" $perGpu) "the group's other models share its GPU" (gt $perGpu 1) -}}
{{- fail (printf "group %q: model %q is greedy (TensorFlow maps nearly all of the GPU at start) but %s; it would starve them: give it a cap or a share" $name (first $greedy) $others) -}}
{{- end -}}
{{- $needed := mul $perGpu $podMiB -}}
{{- if and (not $greedy) (gt $needed $memory) -}}
{{- fail (printf "group %q does not fit its GPU: %d pods per GPU x (%s + %d x %d MiB overhead = %d MiB) = %d MiB, but gpu.memoryMiB is %d MiB; lower the caps or gpu.replicasPerGpu, or give the group a larger GPU or MIG slice" $name $perGpu (join " + " $terms) (len $models) $overhead $podMiB $needed $memory) -}}
{{- end -}}
{{- $graceS := ceil (float64 (default 20 $settings.shutdown_grace_s)) | int -}}
{{- $termination := add (int $root.Values.preStopSleepS) $graceS 10 -}}
{{- if not (kindIs "invalid" $root.Values.terminationGracePeriodSeconds) -}}
{{- $termination = int $root.Values.terminationGracePeriodSeconds -}}
{{- if le $termination (add (int $root.Values.preStopSleepS) $graceS) -}}
{{- fail (printf "terminationGracePeriodSeconds %d must be above preStopSleepS %d + shutdown_grace_s %d of group %q, or requests in flight are killed" $termination (int $root.Values.preStopSleepS) $graceS $name) -}}
{{- end -}}
{{- end -}}
{{- $labelPrefix := trimSuffix ".shared" $gpu.resource -}}
{{- dict
    "name" $name
    "fullname" (printf "%s-%s" (include "detect.fullname" $root) $name)
    "replicas" (int (default 1 $group.replicas))
    "models" $models
    "modelRepository" (default "/srv/detect/models" $group.modelRepository)
    "gpu" $gpu
    "labelPrefix" $labelPrefix
    "settings" $settings
    "resources" $resources
    "podDisruptionBudget" $pdb
    "autoscaling" $autoscaling
    "podMiB" $podMiB
    "neededMiB" $needed
    "shareMiB" (div $memory $perGpu)
    "unbounded" $unbounded
    "greedy" $greedy
    "terminationGracePeriodSeconds" $termination
  | toJson -}}
{{- end -}}

{{/* A TOML value: strings quoted (JSON's escapes are TOML's), numbers and booleans as they are. */}}
{{- define "detect.tomlValue" -}}
{{- if kindIs "string" . -}}
{{- toJson . -}}
{{- else if or (kindIs "bool" .) (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) -}}
{{- toString . -}}
{{- else -}}
{{- fail (printf "settings take strings, numbers and booleans, not %s" (kindOf .)) -}}
{{- end -}}
{{- end -}}

{{/*
The settings file of one group's pods, read with `python -m app serve --config`. Arguments: root, g.
*/}}
{{- define "detect.settingsToml" -}}
{{- $g := .g -}}
{{- $top := deepCopy $g.settings -}}
{{- $_ := set $top "host" "0.0.0.0" -}}
{{- $_ := set $top "port" (int .root.Values.service.port) -}}
{{- if .root.Values.service.grpcPort -}}
{{- $_ := set $top "grpc_port" (int .root.Values.service.grpcPort) -}}
{{- else -}}
{{- $_ := set $top "grpc_port" "off" -}}
{{- end -}}
{{- if eq (len $g.models) 1 -}}
{{- $_ := set $top "model" (printf "%s/%s" (trimSuffix "/" $g.modelRepository) (keys $g.models | first)) -}}
{{- else -}}
{{- $_ := set $top "model_repository" $g.modelRepository -}}
{{- end -}}
{{- $_ := set $top "gpu_total_mib" $g.shareMiB -}}
{{- $_ := set $top "gpu_overhead_mib" (int $g.gpu.overheadMiB) -}}
# Settings of group {{ $g.name }}, rendered by the {{ .root.Chart.Name }} chart. Budget per GPU:
# {{ $g.gpu.replicasPerGpu }} pod(s) x {{ $g.podMiB }} MiB (caps + {{ $g.gpu.overheadMiB }} MiB overhead per model) = {{ $g.neededMiB }} MiB of {{ $g.gpu.memoryMiB }} MiB.
{{- range $key := keys $top | sortAlpha }}
{{ $key }} = {{ include "detect.tomlValue" (get $top $key) }}
{{- end }}
{{- range $model := keys $g.models | sortAlpha }}

[models.{{ $model | toJson }}]
{{- $table := get $g.models $model }}
{{- range $key := keys $table | sortAlpha }}
{{ $key }} = {{ include "detect.tomlValue" (get $table $key) }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The DETECT_* variables of the settings the file sets. A variable beats the file and its [models.*]
tables, so the container drops any the image bakes in (`env -u`): the file alone decides.
*/}}
{{- define "detect.unsetArgs" -}}
{{- $names := list "HOST" "PORT" "GRPC_PORT" "MODEL" "MODEL_REPOSITORY" "GPU_TOTAL_MIB" "GPU_OVERHEAD_MIB" -}}
{{- range $key, $_ := .g.settings -}}
{{- $names = append $names (upper $key) -}}
{{- end -}}
{{- range $model, $table := .g.models -}}
{{- range $key, $_ := $table -}}
{{- $names = append $names (upper $key) -}}
{{- end -}}
{{- end -}}
{{- range $n := $names | uniq | sortAlpha }}
- "-u"
- {{ printf "DETECT_%s" $n | quote }}
{{- end -}}
{{- end -}}
