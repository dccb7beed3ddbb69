{{/* Names and labels (the usual Helm shapes). */}}
{{- define "metrale-worker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "metrale-worker.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "metrale-worker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "metrale-worker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "metrale-worker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "metrale-worker.labels" -}}
helm.sh/chart: {{ include "metrale-worker.chart" . }}
{{ include "metrale-worker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: model-worker
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "metrale-worker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "metrale-worker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "metrale-worker.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
One flag value as the worker's argparse reads it. Numbers go through toJson: Helm holds YAML numbers
as float64, whose default formatting would turn 67108864 into 6.7108864e+07.
*/}}
{{- define "metrale-worker.flagValue" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/*
The container args of `metrale-worker serve`, as a JSON list: one flag per non-null key of .Values.worker
(camelCase field name -> --kebab-case flag; booleans as --flag / --no-flag), then the file paths the
chart mounts: --model, TLS and the auth token. tests/test_helm.py parses them with the worker's own parser.
*/}}
{{- define "metrale-worker.args" -}}
{{- $args := list }}
{{- range $name, $value := .Values.worker }}
{{- if kindIs "bool" $value }}
{{- $args = append $args (printf "--%s%s" (ternary "" "no-" $value) (kebabcase $name)) }}
{{- else if not (kindIs "invalid" $value) }}
{{- $args = concat $args (list (printf "--%s" (kebabcase $name)) (include "metrale-worker.flagValue" $value)) }}
{{- end }}
{{- end }}
{{- $args = concat $args (list "--model" .Values.model.mountPath) }}
{{- with .Values.tls }}
{{- if .enabled }}
{{- $args = concat $args (list "--tls-cert-file" (printf "%s/%s" .mountPath .certKey) "--tls-key-file" (printf "%s/%s" .mountPath .keyKey)) }}
{{- if .clientCa.enabled }}
{{- $args = concat $args (list "--tls-client-ca-file" (printf "%s/%s" .clientCa.mountPath .clientCa.key)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if .Values.authToken.enabled }}
{{- $args = concat $args (list "--auth-token-file" (printf "%s/%s" .Values.authToken.mountPath .Values.authToken.key)) }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{/*
terminationGracePeriodSeconds: the kubelet's deadline counts from the start of the preStop hook, so it
must exceed preStopSleepSeconds + worker.gracePeriodS, or the worker is killed mid-drain.
*/}}
{{- define "metrale-worker.terminationGracePeriodSeconds" -}}
{{- $drain := addf (float64 .Values.preStopSleepSeconds) (float64 .Values.worker.gracePeriodS) }}
{{- $grace := .Values.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $grace }}
{{- add (ceil $drain | int) 15 }}
{{- else if le (float64 $grace) $drain }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed preStopSleepSeconds + worker.gracePeriodS (%v + %v = %v): the kubelet would kill the worker before its drain ends" $grace .Values.preStopSleepSeconds .Values.worker.gracePeriodS $drain) }}
{{- else }}
{{- int64 $grace }}
{{- end }}
{{- end }}

{{/* The DNS name the TLS health probe expects in the worker's certificate. */}}
{{- define "metrale-worker.probeServerName" -}}
{{- default (printf "%s.%s.svc" (include "metrale-worker.fullname" .) .Release.Namespace) .Values.tls.probeServerName }}
{{- end }}

{{/*
One probe: native gRPC against grpc.health.v1 in plaintext; with TLS an exec of files/tls_health_probe.py,
mounted from the probe ConfigMap (the kubelet's gRPC probes do not speak TLS). Called with (dict "root" $ "timing" <probes.x>).
*/}}
{{- define "metrale-worker.probe" -}}
{{- $root := .root }}
{{- if $root.Values.tls.enabled }}
{{- $tls := $root.Values.tls }}
{{- $cmd := list "python" "/etc/metrale/probe/tls_health_probe.py" "--port" (toString (int $root.Values.worker.port)) "--server-name" (include "metrale-worker.probeServerName" $root) "--ca-file" (printf "%s/%s" $tls.mountPath $tls.caKey) "--timeout" (toString .timing.timeoutSeconds) }}
{{- if $tls.clientCa.enabled }}
{{- $cmd = concat $cmd (list "--cert-file" (printf "%s/%s" $tls.mountPath $tls.certKey) "--key-file" (printf "%s/%s" $tls.mountPath $tls.keyKey)) }}
{{- end }}
exec:
  command: {{ toJson $cmd }}
{{- else }}
grpc:
  port: {{ int $root.Values.worker.port }}
  service: ""
{{- end }}
{{ toYaml .timing }}
{{- end }}

{{/* An emptyDir volume source from (dict "medium" .. "sizeLimit" ..), leaving out empty settings. */}}
{{- define "metrale-worker.emptyDir" -}}
{{- $source := dict }}
{{- with .medium }}{{ $_ := set $source "medium" . }}{{ end }}
{{- with .sizeLimit }}{{ $_ := set $source "sizeLimit" . }}{{ end }}
{{- toYaml $source }}
{{- end }}
