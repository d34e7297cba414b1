{{/*
Multi-LoRA (engine/lora/): the pools' and the router's LoRA flags and the adapter volume.
`lora` applies to both pools; `<pool>.lora` overrides its keys for one pool.
*/}}

{{/* The pool's effective LoRA values as YAML. Args: dict root role. */}}
{{- define "cbserve.loraValues" -}}
{{- $root := .root }}
{{- $pool := index $root.Values .role }}
{{- $lora := merge (deepCopy (default dict $pool.lora)) (deepCopy $root.Values.lora) }}
{{- toYaml $lora }}
{{- end }}

{{/* Checks shared by every rendering: adapter names unique, paths inside the volume. */}}
{{- define "cbserve.loraCheck" -}}
{{- $lora := .lora }}
{{- $names := dict }}
{{- range $lora.modules }}
{{- if hasKey $names .name }}
{{- fail (printf "lora.modules names adapter %q twice" .name) }}
{{- end }}
{{- $_ := set $names .name true }}
{{- if and (ne $lora.volume.type "none") (not (hasPrefix (printf "%s/" $lora.volume.mountPath) .path)) }}
{{- fail (printf "lora.modules: adapter %q has path %q, outside lora.volume.mountPath %q" .name .path $lora.volume.mountPath) }}
{{- end }}
{{- end }}
{{- if and $lora.allowRuntimeUpdating (eq $lora.volume.type "none") }}
{{- fail "lora.allowRuntimeUpdating needs lora.volume (pods load runtime adapters only from under its mountPath)" }}
{{- end }}
{{- end }}

{{/* A pool's LoRA flags. Args: dict root role. */}}
{{- define "cbserve.loraArgs" -}}
{{- $lora := include "cbserve.loraValues" . | fromYaml }}
{{- if $lora.enabled }}
{{- include "cbserve.loraCheck" (dict "lora" $lora) }}
- --enable-lora
- --max-loras={{ $lora.maxLoras }}
{{- if not (kindIs "invalid" $lora.maxCpuLoras) }}
- --max-cpu-loras={{ $lora.maxCpuLoras }}
{{- end }}
- --max-lora-rank={{ $lora.maxLoraRank }}
{{- range $lora.modules }}
- --lora-modules={{ .name }}={{ .path }}
{{- end }}
{{- if $lora.allowRuntimeUpdating }}
- --allow-runtime-lora-updating
- --lora-root={{ $lora.volume.mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{/* The router's LoRA flags. Arg: root. */}}
{{- define "cbserve.loraRouterArgs" -}}
{{- if .Values.lora.enabled }}
- --enable-lora
{{- if .Values.lora.allowRuntimeUpdating }}
- --allow-runtime-lora-updating
{{- end }}
{{- end }}
{{- end }}

{{/* The adapter volume of a pool (read-only). Arg: root. */}}
{{- define "cbserve.loraVolumes" -}}
{{- $lora := .Values.lora }}
{{- if and $lora.enabled (eq $lora.volume.type "pvc") }}
- name: lora-adapters
  persistentVolumeClaim:
    claimName: {{ $lora.volume.pvc.claimName }}
    readOnly: true
{{- else if and $lora.enabled (eq $lora.volume.type "hostPath") }}
- name: lora-adapters
  hostPath:
    path: {{ $lora.volume.hostPath.path }}
    type: {{ $lora.volume.hostPath.type }}
{{- end }}
{{- end }}

{{- define "cbserve.loraVolumeMounts" -}}
{{- $lora := .Values.lora }}
{{- if and $lora.enabled (ne $lora.volume.type "none") }}
- name: lora-adapters
  mountPath: {{ $lora.volume.mountPath }}
  readOnly: true
  {{- if and (eq $lora.volume.type "pvc") $lora.volume.pvc.subPath }}
  subPath: {{ $lora.volume.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}
