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
The health-only port (--health-port) as the chart runs it: worker.healthPort when > 0; with tls.enabled and
healthPort 0 or null, 8081 (the kubelet's gRPC probes speak plaintext only and need it); else 0 (off).
Fails when it would share a port with worker.port or worker.metricsPort.
*/}}
{{- define "metrale-worker.healthPort" -}}
{{- $worker := .Values.worker }}
{{- $port := int $worker.healthPort }}
{{- if and (eq $port 0) .Values.tls.enabled }}{{ $port = 8081 }}{{ end }}
{{- if and (gt $port 0) (or (eq $port (int $worker.port)) (eq $port (int $worker.metricsPort))) }}
{{- fail (printf "worker.healthPort (%d%s) must differ from worker.port (%d) and worker.metricsPort (%d)" $port (ternary ", the default with tls.enabled" "" (eq (int $worker.healthPort) 0)) (int $worker.port) (int $worker.metricsPort)) }}
{{- end }}
{{- $port }}
{{- end }}

{{/*
The container args of `metrale-worker serve`, as a JSON list: one flag per non-null key of .Values.worker
(camelCase field name -> --kebab-case flag; booleans as --flag / --no-flag; healthPort as
metrale-worker.healthPort resolves it with TLS), then the file paths the chart mounts: --model, TLS and the
auth token. tests/unit/test_helm.py parses them with the worker's own parser.
*/}}
{{- define "metrale-worker.args" -}}
{{- $args := list }}
{{- $worker := deepCopy .Values.worker }}
{{- if .Values.tls.enabled }}
{{- $_ := set $worker "healthPort" (include "metrale-worker.healthPort" . | int) }}
{{- end }}
{{- range $name, $value := $worker }}
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

{{/* The DNS name in the worker's certificate that NOTES.txt's grpcurl commands expect (tls.probeServerName). */}}
{{- define "metrale-worker.probeServerName" -}}
{{- default (printf "%s.%s.svc" (include "metrale-worker.fullname" .) .Release.Namespace) .Values.tls.probeServerName }}
{{- end }}

{{/*
One probe: the kubelet's native gRPC probe against grpc.health.v1 (service ""), on worker.port in plaintext;
with tls.enabled on the plaintext health-only port (metrale-worker.healthPort), as the kubelet's gRPC probes
do not speak TLS. Called with (dict "root" $ "timing" <probes.x>).
*/}}
{{- define "metrale-worker.probe" -}}
{{- $root := .root }}
grpc:
  port: {{ ternary (include "metrale-worker.healthPort" $root | int) (int $root.Values.worker.port) $root.Values.tls.enabled }}
  service: ""
{{ toYaml .timing }}
{{- end }}

{{/* An emptyDir volume source from (dict "medium" .. "sizeLimit" ..), leaving out empty settings. */}}
{{- define "metrale-worker.emptyDir" -}}
{{- $source := dict }}
{{- with .medium }}{{ $_ := set $source "medium" . }}{{ end }}
{{- with .sizeLimit }}{{ $_ := set $source "sizeLimit" . }}{{ end }}
{{- toYaml $source }}
{{- end }}

{{/*
The gateway (smg): its name, labels and image. Its pods carry their own app.kubernetes.io/name, so neither
the workers' Deployment nor their Service selects them.
*/}}
{{- define "metrale-worker.gatewayName" -}}
{{- printf "%s-gateway" (include "metrale-worker.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "metrale-worker.gatewaySelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-gateway" (include "metrale-worker.name" . | trunc 55 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "metrale-worker.gatewayLabels" -}}
helm.sh/chart: {{ include "metrale-worker.chart" . }}
{{ include "metrale-worker.gatewaySelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.gateway.image.tag | quote }}
app.kubernetes.io/component: gateway
app.kubernetes.io/part-of: {{ include "metrale-worker.name" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "metrale-worker.gatewayImage" -}}
{{- with .Values.gateway.image }}
{{- if .digest }}{{ printf "%s@%s" .repository .digest }}{{ else }}{{ printf "%s:%s" .repository .tag }}{{ end }}
{{- end }}
{{- end }}

{{/*
The gateway's container args (the image runs smg, which takes `smg launch`'s flags), as a JSON list:
Kubernetes discovery of this release's worker pods (their selector labels, worker.port, the release
namespace; smg registers each Ready pod's ip:port and detects its gRPC service), the policy, ports on all
interfaces of the pod, then gateway.extraArgs. tests/unit/test_helm.py
parses them with smg's own parser. smg dials workers in plaintext gRPC and sends no token, so the chart
fails with tls.enabled or authToken.enabled.
*/}}
{{- define "metrale-worker.gatewayArgs" -}}
{{- $gateway := .Values.gateway }}
{{- if .Values.tls.enabled }}
{{- fail "gateway.enabled needs tls.enabled false: smg dials workers over plaintext gRPC only (no TLS client)" }}
{{- end }}
{{- if .Values.authToken.enabled }}
{{- fail "gateway.enabled needs authToken.enabled false: smg sends no bearer token to its workers" }}
{{- end }}
{{- if eq (int $gateway.port) (int $gateway.metricsPort) }}
{{- fail (printf "gateway.port and gateway.metricsPort must differ, both are %d" (int $gateway.port)) }}
{{- end }}
{{- $selector := list }}
{{- range $key, $value := include "metrale-worker.selectorLabels" . | fromYaml }}
{{- $selector = append $selector (printf "%s=%s" $key $value) }}
{{- end }}
{{- $args := list "--host" "0.0.0.0" "--port" (toString (int $gateway.port)) }}
{{- $args = concat $args (list "--prometheus-host" "0.0.0.0" "--prometheus-port" (toString (int $gateway.metricsPort))) }}
{{- $args = concat $args (list "--policy" $gateway.policy "--log-level" $gateway.logLevel) }}
{{- /* --enable-igw: smg's own launcher turns it on whenever discovery is on; said here so the binary does too */}}
{{- $args = concat $args (list "--service-discovery" "--enable-igw" "--selector") $selector }}
{{- $args = concat $args (list "--service-discovery-port" (toString (int .Values.worker.port))) }}
{{- $args = concat $args (list "--service-discovery-namespace" .Release.Namespace) }}
{{- $args = concat $args $gateway.extraArgs }}
{{- toJson $args }}
{{- end }}
