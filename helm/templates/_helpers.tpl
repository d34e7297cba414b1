{{/*
Naming, labels and the derived values (drain timing, probe sizing) shared by every template.
*/}}

{{- define "cbserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cbserve.fullname" -}}
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

{{/* Name of a component's objects: <fullname>-<component>, short enough for pod names. */}}
{{- define "cbserve.componentName" -}}
{{- printf "%s-%s" (include "cbserve.fullname" .root | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{- define "cbserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cbserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cbserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "cbserve.labels" -}}
helm.sh/chart: {{ include "cbserve.chart" . }}
{{ include "cbserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cbserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component (router, prefill, decode). Args: dict root component. */}}
{{- define "cbserve.componentSelectorLabels" -}}
{{ include "cbserve.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "cbserve.componentLabels" -}}
{{ include "cbserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "cbserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "cbserve.routerServiceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "cbserve.componentName" (dict "root" . "component" "router")) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* True ("true") when the chart runs a prefill pool in front of the decode pool. */}}
{{- define "cbserve.disaggregated" -}}
{{- if .Values.prefill.enabled }}true{{ end }}
{{- end }}

{{/*
Drain timing of one component. The drain window is the process's `--drain-seconds`; the grace
period is derived from it so the kubelet never SIGKILLs a pod that is still inside its window:
  terminationGracePeriodSeconds = preStopSeconds + drainSeconds + killMarginSeconds
Args: dict root component.
*/}}
{{- define "cbserve.drainSeconds" -}}
{{- $override := (index .root.Values .component).drainSeconds }}
{{- if kindIs "invalid" $override }}{{ .root.Values.drain.seconds }}{{ else }}{{ $override }}{{ end }}
{{- end }}

{{- define "cbserve.terminationGracePeriodSeconds" -}}
{{- $drain := include "cbserve.drainSeconds" . | int }}
{{- add .root.Values.drain.preStopSeconds $drain .root.Values.drain.killMarginSeconds }}
{{- end }}

{{/*
preStop hook: wait for endpoint removal to propagate before SIGTERM. The native sleep action
(beta, on by default, from 1.30) needs no shell in the image; 1.29 falls back to exec sleep.
*/}}
{{- define "cbserve.preStop" -}}
{{- if semverCompare ">=1.30-0" .Capabilities.KubeVersion.Version }}
sleep:
  seconds: {{ .Values.drain.preStopSeconds }}
{{- else }}
exec:
  command: ["sleep", "{{ .Values.drain.preStopSeconds }}"]
{{- end }}
{{- end }}

{{/* Startup probe failureThreshold: ceil(model.loadTimeoutSeconds / periodSeconds). */}}
{{- define "cbserve.startupFailureThreshold" -}}
{{- $period := int .Values.probes.startup.periodSeconds }}
{{- div (add (int .Values.model.loadTimeoutSeconds) (sub $period 1)) $period }}
{{- end }}

{{/* Percentage of an SLO in milliseconds, as a Kubernetes quantity in seconds ("450m" = 0.45 s). */}}
{{- define "cbserve.sloGuardQuantity" -}}
{{- printf "%dm" (div (mul (int .sloMs) (int .percent)) 100) }}
{{- end }}

{{/* Checks the schema cannot express (cross-field constraints). */}}
{{- define "cbserve.validate" -}}
{{- $vol := .Values.model.volume }}
{{- $mount := trimSuffix "/" $vol.mountPath }}
{{- if and (ne $vol.type "none") (ne (trimSuffix "/" .Values.model.name) $mount) (not (hasPrefix (printf "%s/" $mount) .Values.model.name)) }}
{{- fail (printf "model.name %q must be %q or a path under it when model.volume.type is %q" .Values.model.name $mount $vol.type) }}
{{- end }}
{{- if and .Values.prefill.enabled (ne (int .Values.prefill.engine.blockSize) (int .Values.decode.engine.blockSize)) }}
{{- fail "prefill.engine.blockSize and decode.engine.blockSize must be equal: KV blocks move between the pools as-is" }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $as := (index $.Values $pool).autoscaling }}
{{- if and $as.enabled (gt (int $as.minReplicas) (int $as.maxReplicas)) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) must not exceed maxReplicas (%d)" $pool (int $as.minReplicas) (int $as.maxReplicas)) }}
{{- end }}
{{- end }}
{{- if and .Values.decode.autoscaling.enabled (kindIs "invalid" .Values.decode.autoscaling.targetRunningRequestsPerPod) (kindIs "invalid" .Values.decode.autoscaling.targetKvCacheUsageRatio) }}
{{- fail "decode.autoscaling needs targetRunningRequestsPerPod or targetKvCacheUsageRatio" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled needs tls.secretName: a Secret with tls.crt, tls.key and ca.crt" }}
{{- end }}
{{- if gt (int .Values.kvDataPortRange.start) (int .Values.kvDataPortRange.end) }}
{{- fail "kvDataPortRange.start must not exceed kvDataPortRange.end" }}
{{- end }}
{{- end }}
