{{/*
Model volume options and the writable scratch space every cbserve container needs (the root
filesystem is read-only). Args of the model helpers: dict root copy, where copy=true (pool pods)
turns `copyFromPvc` into an init-container copy onto node-local disk, and copy=false (router)
mounts the source claim read-only, since the router only reads tokenizer files.
*/}}

{{- define "cbserve.cacheDir" -}}/var/cache/cbserve{{- end }}

{{/* Environment shared by every cbserve container. */}}
{{- define "cbserve.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
# The address a decode pod advertises for its KV TCPStore (nccl transport) to prefill pods.
- name: CBSERVE_POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOME
  value: /tmp
- name: CBSERVE_CACHE_DIR
  value: {{ include "cbserve.cacheDir" . }}
- name: TRITON_CACHE_DIR
  value: {{ include "cbserve.cacheDir" . }}/triton
{{- end }}

{{- define "cbserve.modelVolumes" -}}
{{- $vol := .root.Values.model.volume }}
{{- if eq $vol.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $vol.pvc.claimName }}
    readOnly: true
{{- else if eq $vol.type "hostPath" }}
- name: model
  hostPath:
    path: {{ $vol.hostPath.path }}
    type: {{ $vol.hostPath.type }}
{{- else if eq $vol.type "copyFromPvc" }}
{{- if .copy }}
- name: model-source
  persistentVolumeClaim:
    claimName: {{ $vol.copyFromPvc.claimName }}
    readOnly: true
- name: model
  emptyDir:
    sizeLimit: {{ $vol.copyFromPvc.sizeLimit }}
{{- else }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $vol.copyFromPvc.claimName }}
    readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{- define "cbserve.modelVolumeMounts" -}}
{{- $vol := .root.Values.model.volume }}
{{- if ne $vol.type "none" }}
- name: model
  mountPath: {{ $vol.mountPath }}
  readOnly: true
  {{- if and (eq $vol.type "pvc") $vol.pvc.subPath }}
  subPath: {{ $vol.pvc.subPath }}
  {{- else if and (eq $vol.type "copyFromPvc") (not .copy) $vol.copyFromPvc.subPath }}
  subPath: {{ $vol.copyFromPvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Init container that copies the checkpoint from the claim into the pod's emptyDir. */}}
{{- define "cbserve.modelCopyInitContainer" -}}
{{- $root := . }}
{{- $vol := .Values.model.volume }}
{{- if eq $vol.type "copyFromPvc" }}
- name: copy-model
  image: {{ include "cbserve.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  # Copy into a temporary name and rename at the end, so a restarted init container never
  # leaves a half-copied checkpoint that the engine would then try to load.
  command:
    - sh
    - -ec
    - |
      src="/model-source/{{ $vol.copyFromPvc.subPath }}"
      if [ -e "{{ $vol.mountPath }}/.cbserve-copied" ]; then exit 0; fi
      rm -rf "{{ $vol.mountPath }}/.partial"
      mkdir -p "{{ $vol.mountPath }}/.partial"
      cp -R "$src/." "{{ $vol.mountPath }}/.partial/"
      for entry in "{{ $vol.mountPath }}/.partial/"* "{{ $vol.mountPath }}/.partial/".[!.]*; do
        if [ -e "$entry" ]; then mv "$entry" "{{ $vol.mountPath }}/"; fi
      done
      rmdir "{{ $vol.mountPath }}/.partial"
      touch "{{ $vol.mountPath }}/.cbserve-copied"
  securityContext:
    {{- toYaml $root.Values.containerSecurityContext | nindent 4 }}
  resources:
    requests:
      cpu: 500m
      memory: 256Mi
    limits:
      memory: 1Gi
  volumeMounts:
    - name: model-source
      mountPath: /model-source
      readOnly: true
    - name: model
      mountPath: {{ $vol.mountPath }}
{{- end }}
{{- end }}

{{/* Scratch volumes: /dev/shm (size per pool), the cache dir and /tmp. Args: dict root shmSizeLimit. */}}
{{- define "cbserve.scratchVolumes" -}}
{{- if .shmSizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSizeLimit }}
{{- end }}
- name: cache
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "cbserve.scratchVolumeMounts" -}}
{{- if .shmSizeLimit }}
- name: dshm
  mountPath: /dev/shm
{{- end }}
- name: cache
  mountPath: {{ include "cbserve.cacheDir" .root }}
- name: tmp
  mountPath: /tmp
{{- end }}
