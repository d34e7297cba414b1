{{/*
One engine pool (prefill or decode): Deployment and headless Service. Both pools run the same
image and flags; the role changes the subcommand, the gRPC service the probes ask for, and the
decode-only flag. Args: dict root role.
*/}}

{{- define "cbserve.grpcServiceName" -}}
{{- if eq . "prefill" }}cbserve.v1.PrefillService{{ else }}cbserve.v1.DecodeService{{ end }}
{{- end }}

{{- define "cbserve.poolDeployment" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $pool := index $root.Values $role }}
{{- $ctx := dict "root" $root "component" $role }}
{{- $device := ternary "cuda" "cpu" (gt (int $pool.gpus) 0) }}
{{- $tp := int (default 1 $pool.engine.tensorParallelSize) }}
{{- if and (gt $tp 1) (ne $root.Values.kvTransport "grpc") }}
{{- fail (printf "%s.engine.tensorParallelSize=%d needs kvTransport=grpc (tensor-parallel pods gather KV to rank 0)" $role $tp) }}
{{- end }}
{{- /* One GPU per tensor-parallel rank. */}}
{{- $gpus := ternary (max (int $pool.gpus) $tp) 0 (gt (int $pool.gpus) 0) }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "cbserve.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cbserve.componentLabels" $ctx | nindent 4 }}
spec:
  {{- if not $pool.autoscaling.enabled }}
  replicas: {{ $pool.replicas }}
  {{- end }}
  # Surge first: a new pod loads its model before an old one starts draining.
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "cbserve.componentSelectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "cbserve.componentSelectorLabels" $ctx | nindent 8 }}
        {{- with $pool.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $pool.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      # Engine pods never talk to the Kubernetes API.
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ include "cbserve.terminationGracePeriodSeconds" $ctx }}
      {{- with $root.Values.image.pullSecrets }}
      imagePullSecrets:
        {{- range . }}
        - name: {{ . }}
        {{- end }}
      {{- end }}
      {{- with $pool.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if eq $root.Values.model.volume.type "copyFromPvc" }}
      initContainers:
        {{- with (include "cbserve.modelCopyInitContainer" $root | trim) }}{{ . | nindent 8 }}{{ end }}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "cbserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - {{ $role }}
            - --model={{ $root.Values.model.name }}
            - --host=0.0.0.0
            - --port={{ $root.Values.ports.grpc }}
            - --metrics-port={{ $root.Values.ports.metrics }}
            - --device={{ $device }}
            - --dtype={{ $root.Values.model.dtype }}
            {{- with $root.Values.model.quantization }}
            - --quantization={{ . }}
            {{- end }}
            {{- with $root.Values.model.kvCacheDtype }}
            - --kv-cache-dtype={{ . }}
            {{- end }}
            - --kv-transport={{ $root.Values.kvTransport }}
            - --kv-store-port={{ $root.Values.ports.kvStore }}
            - --kv-ttl-seconds={{ $root.Values.kvTtlSeconds }}
            - --drain-seconds={{ include "cbserve.drainSeconds" $ctx }}
            - --max-num-batched-tokens={{ $pool.engine.maxNumBatchedTokens }}
            - --max-num-seqs={{ $pool.engine.maxNumSeqs }}
            - --block-size={{ $pool.engine.blockSize }}
            {{- if not (kindIs "invalid" $pool.engine.numBlocks) }}
            - --num-blocks={{ $pool.engine.numBlocks }}
            {{- end }}
            {{- if not (kindIs "invalid" $pool.engine.kvCacheMemoryMb) }}
            - --kv-cache-memory-mb={{ $pool.engine.kvCacheMemoryMb }}
            {{- end }}
            {{- $utilization := $pool.engine.gpuMemoryUtilization }}
            {{- $sized := or (not (kindIs "invalid" $pool.engine.numBlocks)) (not (kindIs "invalid" $pool.engine.kvCacheMemoryMb)) }}
            {{- if and (eq $device "cuda") (or (not (kindIs "invalid" $utilization)) (not $sized)) }}
            # The KV cache takes what the weights and one worst-case step leave of this share.
            - --gpu-memory-utilization={{ ternary 0.9 $utilization (kindIs "invalid" $utilization) }}
            {{- end }}
            {{- if $pool.engine.enforceEager }}
            - --enforce-eager
            {{- end }}
            {{- if and (eq $role "prefill") $root.Values.decode.engine.speculativeConfig }}
            # A speculating decode pod keeps one KV group (its draft shares the target's tables): the
            # prefill pods it pulls from must too, else the handshake refuses the pair.
            - --kv-cache-groups=single
            {{- end }}
            {{- if $pool.engine.speculativeConfig }}
            # Drafts are verified where decode steps run; a prefill pool given the decode pool's draft
            # model (opt-in) prefills it too and ships its KV with the target's.
            - {{ printf "--speculative-config=%s" (toJson $pool.engine.speculativeConfig) | quote }}
            {{- end }}
            {{- if gt $tp 1 }}
            # One process per rank; rank 0 spawns the others and they meet on 127.0.0.1.
            - --tensor-parallel-size={{ $tp }}
            {{- end }}
            - --pod-id=$(POD_NAME)
            {{- if and (eq $role "decode") (not $root.Values.prefill.enabled) }}
            # No prefill pool: this pod prefills every request itself (role label "colocated").
            - --colocated
            {{- else if and (eq $role "decode") $pool.disableLocalPrefillFallback }}
            - --no-local-prefill-fallback
            {{- end }}
            {{- with (include "cbserve.loraArgs" (dict "root" $root "role" $role) | trim) }}{{ . | nindent 12 }}{{ end }}
            {{- include "cbserve.trustArgs" (dict "root" $root "role" $role) | nindent 12 }}
          env:
            {{- with (include "cbserve.commonEnv" $root | trim) }}{{ . | nindent 12 }}{{ end }}
            {{- with $pool.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $root.Values.ports.grpc }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $root.Values.ports.metrics }}
              protocol: TCP
            {{- if eq $root.Values.kvTransport "nccl" }}
            - name: kv-store
              containerPort: {{ $root.Values.ports.kvStore }}
              protocol: TCP
            {{- end }}
          # Model load, warm-up and kernel compilation happen before the health service reports
          # SERVING; liveness and readiness only start once this succeeds.
          startupProbe:
            grpc:
              port: {{ include "cbserve.probePort" $root }}
              service: {{ include "cbserve.grpcServiceName" $role }}
            periodSeconds: {{ $root.Values.probes.startup.periodSeconds }}
            timeoutSeconds: {{ $root.Values.probes.startup.timeoutSeconds }}
            failureThreshold: {{ include "cbserve.startupFailureThreshold" $root }}
          # NOT_SERVING from the moment SIGTERM arrives, so the pod leaves the endpoints at once.
          readinessProbe:
            grpc:
              port: {{ include "cbserve.probePort" $root }}
              service: {{ include "cbserve.grpcServiceName" $role }}
            periodSeconds: {{ $root.Values.probes.readiness.periodSeconds }}
            timeoutSeconds: {{ $root.Values.probes.readiness.timeoutSeconds }}
            failureThreshold: {{ $root.Values.probes.readiness.failureThreshold }}
          # Process liveness only: the metrics server runs on its own thread, so neither a long
          # kernel compilation in the engine thread nor draining (health NOT_SERVING) fails it.
          livenessProbe:
            httpGet:
              path: /metrics
              port: metrics
            periodSeconds: {{ $root.Values.probes.liveness.periodSeconds }}
            timeoutSeconds: {{ $root.Values.probes.liveness.timeoutSeconds }}
            failureThreshold: {{ $root.Values.probes.liveness.failureThreshold }}
          lifecycle:
            preStop:
              {{- with (include "cbserve.preStop" $root | trim) }}{{ . | nindent 14 }}{{ end }}
          resources:
            {{- $resources := deepCopy (default dict $pool.resources) }}
            {{- if gt $gpus 0 }}
            {{- $limits := merge (dict $root.Values.gpuResourceName $gpus) (default dict $resources.limits) }}
            {{- $requests := merge (dict $root.Values.gpuResourceName $gpus) (default dict $resources.requests) }}
            {{- $_ := set $resources "limits" $limits }}
            {{- $_ := set $resources "requests" $requests }}
            {{- end }}
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            {{- with (include "cbserve.scratchVolumeMounts" (dict "root" $root "shmSizeLimit" $pool.shmSizeLimit) | trim) }}{{ . | nindent 12 }}{{ end }}
            {{- with (include "cbserve.modelVolumeMounts" (dict "root" $root "copy" true) | trim) }}{{ . | nindent 12 }}{{ end }}
            {{- with (include "cbserve.loraVolumeMounts" $root | trim) }}{{ . | nindent 12 }}{{ end }}
            {{- include "cbserve.trustVolumeMounts" $root | nindent 12 }}
      volumes:
        {{- with (include "cbserve.scratchVolumes" (dict "root" $root "shmSizeLimit" $pool.shmSizeLimit) | trim) }}{{ . | nindent 8 }}{{ end }}
        {{- with (include "cbserve.modelVolumes" (dict "root" $root "copy" true) | trim) }}{{ . | nindent 8 }}{{ end }}
        {{- with (include "cbserve.loraVolumes" $root | trim) }}{{ . | nindent 8 }}{{ end }}
        {{- include "cbserve.trustVolumes" $root | nindent 8 }}
      {{- with $pool.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $pool.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}

{{/*
Headless Service of a pool: the router discovers its pods through the Service's EndpointSlices
(port name "grpc") and talks to each pod directly, so there is no virtual IP to balance through.
*/}}
{{- define "cbserve.poolService" -}}
{{- $root := .root }}
{{- $ctx := dict "root" $root "component" .role }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "cbserve.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "cbserve.componentLabels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  # Only ready pods: a pod still loading or already draining must not be picked by the router.
  publishNotReadyAddresses: false
  selector:
    {{- include "cbserve.componentSelectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $root.Values.ports.grpc }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ $root.Values.ports.metrics }}
      targetPort: metrics
      protocol: TCP
    {{- if eq $root.Values.kvTransport "nccl" }}
    - name: kv-store
      port: {{ $root.Values.ports.kvStore }}
      targetPort: kv-store
      protocol: TCP
    {{- end }}
{{- end }}
