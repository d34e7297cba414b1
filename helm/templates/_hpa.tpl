{{/*
HorizontalPodAutoscaler of one pool. Load metrics are per-pod Pods metrics with AverageValue
targets (the HPA keeps their mean at the target); the SLO guard is the pool-wide latency p95 as an
Object metric on the pool's Deployment. The HPA takes the largest recommendation, so the guard only
ever adds pods when the SLO is at risk. See docs/autoscaling.md.
Args: dict root role metrics (list of MetricSpec dicts).
*/}}
{{- define "cbserve.hpa" -}}
{{- $root := .root }}
{{- $ctx := dict "root" $root "component" .role }}
{{- $as := (index $root.Values .role).autoscaling }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "cbserve.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cbserve.componentLabels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "cbserve.componentName" $ctx }}
  minReplicas: {{ $as.minReplicas }}
  maxReplicas: {{ $as.maxReplicas }}
  metrics:
    {{- toYaml .metrics | nindent 4 }}
  # Up fast (new capacity takes a model load to arrive), down slowly (a removed pod drains its
  # streams, and a reload costs minutes if the load comes back).
  behavior:
    scaleUp:
      stabilizationWindowSeconds: {{ $as.behavior.scaleUp.stabilizationWindowSeconds }}
      selectPolicy: Max
      policies:
        - type: Percent
          value: {{ $as.behavior.scaleUp.maxPercentPerPeriod }}
          periodSeconds: {{ $as.behavior.scaleUp.periodSeconds }}
        - type: Pods
          value: {{ $as.behavior.scaleUp.maxPodsPerPeriod }}
          periodSeconds: {{ $as.behavior.scaleUp.periodSeconds }}
    scaleDown:
      stabilizationWindowSeconds: {{ $as.behavior.scaleDown.stabilizationWindowSeconds }}
      selectPolicy: Min
      policies:
        - type: Pods
          value: {{ $as.behavior.scaleDown.maxPodsPerPeriod }}
          periodSeconds: {{ $as.behavior.scaleDown.periodSeconds }}
{{- end }}

{{/* Pods metric with an AverageValue target. Args: dict name value. */}}
{{- define "cbserve.podsMetric" -}}
type: Pods
pods:
  metric:
    name: {{ .name }}
  target:
    type: AverageValue
    averageValue: {{ .value | quote }}
{{- end }}

{{/* Object metric on the pool's Deployment with a Value target. Args: dict root role name value. */}}
{{- define "cbserve.guardMetric" -}}
type: Object
object:
  describedObject:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "cbserve.componentName" (dict "root" .root "component" .role) }}
  metric:
    name: {{ .name }}
  target:
    type: Value
    value: {{ .value | quote }}
{{- end }}
