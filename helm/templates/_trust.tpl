{{/*
Trust between the router and the pods (docs/architecture.md, "Pods trust only their cluster").
Every pod RPC but gRPC health must carry the deployment secret; it also keys the KV handles the
router signs. The secret is a file in every cbserve container (`--cluster-secret-file`), from
`clusterSecret.existingSecret` or the Secret this chart generates once (cluster-secret.yaml).
With `tls.enabled`, pods serve mutual TLS from `tls.secretName` (tls.crt, tls.key, ca.crt: the
cert-manager layout); the router and decode pods present the same certificate and verify pods by
`tls.serverName`; the kubelet's gRPC probes (plaintext only) go to `ports.health`, where nothing
but grpc.health.v1 is served.
*/}}

{{- define "cbserve.clusterSecretName" -}}
{{- default (include "cbserve.componentName" (dict "root" . "component" "cluster-secret")) .Values.clusterSecret.existingSecret }}
{{- end }}

{{- define "cbserve.trustDir" -}}/etc/cbserve{{- end }}

{{/* Flags of the router (role "router") or a pool pod. Args: dict root role. */}}
{{- define "cbserve.trustArgs" -}}
{{- $root := .root }}
{{- $dir := include "cbserve.trustDir" $root }}
- --cluster-secret-file={{ $dir }}/cluster-secret/secret
{{- if $root.Values.tls.enabled }}
- --tls-cert={{ $dir }}/tls/tls.crt
- --tls-key={{ $dir }}/tls/tls.key
- --tls-ca={{ $dir }}/tls/ca.crt
- --tls-server-name={{ $root.Values.tls.serverName }}
{{- if ne .role "router" }}
- --health-port={{ $root.Values.ports.health }}
{{- end }}
{{- end }}
{{- end }}

{{- define "cbserve.trustVolumes" -}}
- name: cluster-secret
  secret:
    secretName: {{ include "cbserve.clusterSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.clusterSecret.secretKey }}
        path: secret
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "cbserve.trustVolumeMounts" -}}
- name: cluster-secret
  mountPath: {{ include "cbserve.trustDir" . }}/cluster-secret
  readOnly: true
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "cbserve.trustDir" . }}/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The port the kubelet's gRPC probes use: the serving port, or the plaintext health port under TLS. */}}
{{- define "cbserve.probePort" -}}
{{- if .Values.tls.enabled }}{{ .Values.ports.health }}{{ else }}{{ .Values.ports.grpc }}{{ end }}
{{- end }}
