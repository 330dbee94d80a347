{{/*
Pod template shared by the drafter Deployments and the verifier StatefulSet:
include "crossdraft.modelServerPodTemplate" (list $ "drafter" [values]); values default to .Values.<comp>
(a drafters entry: the ctx of crossdraft.drafterKinds, list $ "drafter-<name>" <its values>).
*/}}
{{- define "crossdraft.modelServerPodTemplate" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $v := index $root.Values $comp -}}
{{- if gt (len .) 2 }}{{ $v = index . 2 }}{{ end -}}
{{- $role := ternary "drafter" $comp (hasPrefix "drafter-" $comp) -}}
{{- $hubModel := include "crossdraft.isHubId" $v.model -}}
{{- $download := and $hubModel $root.Values.hub.download.enabled -}}
metadata:
  labels:
    {{- include "crossdraft.labels" . | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "crossdraft.serviceAccountName" (list $root $role) }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $root.Values.global.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- if $download }}
  # Downloads the Hub model into the cache once, before the server starts (startup probes then
  # cover only loading); a model already in the cache costs one revision lookup.
  initContainers:
    - name: download-model
      image: {{ include "crossdraft.image" (list $root $v.image) | quote }}
      imagePullPolicy: {{ include "crossdraft.pullPolicy" (list $root $v.image) }}
      command: ["python", "-m", "crossdraft.cli", "models", "download"]
      env:
        - name: CROSSDRAFT_MODEL
          valueFrom:
            configMapKeyRef:
              name: {{ include "crossdraft.modelsConfigName" $root }}
              key: {{ $comp }}-model
        - name: CROSSDRAFT_HOME
          value: /models
        - name: HOME
          value: /tmp
        {{- include "crossdraft.hubEnv" . | nindent 8 }}
      resources:
        {{- toYaml $root.Values.hub.download.resources | nindent 8 }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      volumeMounts:
        - name: models
          mountPath: /models
        - name: tmp
          mountPath: /tmp
        {{- with (include "crossdraft.hubMounts" $root | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
  {{- end }}
  containers:
    - name: {{ $role }}
      image: {{ include "crossdraft.image" (list $root $v.image) | quote }}
      imagePullPolicy: {{ include "crossdraft.pullPolicy" (list $root $v.image) }}
      ports:
        - name: grpc
          containerPort: {{ $v.ports.grpc }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $v.ports.metrics }}
          protocol: TCP
        {{- if $root.Values.tls.enabled }}
        - name: health
          containerPort: {{ $root.Values.tls.healthPort }}
          protocol: TCP
        {{- end }}
      env:
        - name: CROSSDRAFT_MODEL
          valueFrom:
            configMapKeyRef:
              name: {{ include "crossdraft.modelsConfigName" $root }}
              key: {{ $comp }}-model
        - name: CROSSDRAFT_DTYPE
          value: {{ $v.dtype | quote }}
        {{- if eq $role "drafter" }}
        - name: CROSSDRAFT_QUANTIZE
          value: {{ $v.quantize | quote }}
        {{- end }}
        - name: CROSSDRAFT_DEVICE
          value: {{ $v.device | quote }}
        - name: CROSSDRAFT_CPU_LINEAR
          value: {{ $v.cpuLinear | default "auto" | quote }}
        - name: CROSSDRAFT_HOST
          value: "0.0.0.0"
        - name: CROSSDRAFT_PORT
          value: {{ $v.ports.grpc | quote }}
        - name: CROSSDRAFT_METRICS_PORT
          value: {{ $v.ports.metrics | quote }}
        - name: CROSSDRAFT_MAX_SESSIONS
          value: {{ $v.maxSessions | quote }}
        - name: CROSSDRAFT_SESSION_TTL_S
          value: {{ $v.sessionTtlSeconds | quote }}
        - name: CROSSDRAFT_BATCHING
          value: {{ ternary "on" "off" $v.batching.enabled | quote }}
        - name: CROSSDRAFT_MAX_BATCH_ROWS
          value: {{ $v.batching.maxRows | quote }}
        - name: CROSSDRAFT_MAX_BATCH_TOKENS
          value: {{ $v.batching.maxTokens | quote }}
        - name: CROSSDRAFT_BATCH_WAIT_MS
          value: {{ $v.batching.waitMs | quote }}
        - name: CROSSDRAFT_PREFILL_CHUNK
          value: {{ $v.batching.prefillChunk | quote }}
        - name: CROSSDRAFT_KV_CACHE_TOKENS
          value: {{ $v.batching.kvCacheTokens | quote }}
        - name: CROSSDRAFT_KV_CACHE_MEMORY_FRACTION
          value: {{ $v.batching.kvCacheMemoryFraction | quote }}
        - name: CROSSDRAFT_CUDA_GRAPHS
          value: {{ $v.batching.cudaGraphs | default "auto" | quote }}
        - name: CROSSDRAFT_CPU_TURNS
          value: {{ $v.batching.cpuTurns | default "auto" | quote }}
        - name: CROSSDRAFT_LOG_LEVEL
          value: {{ $v.logLevel | quote }}
        {{- if $root.Values.tls.enabled }}
        # mutual TLS: files from the Secret tls.modelServerSecret (re-read when they rotate)
        - name: CROSSDRAFT_TLS_CERT_FILE
          value: /etc/crossdraft/tls/server/tls.crt
        - name: CROSSDRAFT_TLS_KEY_FILE
          value: /etc/crossdraft/tls/server/tls.key
        - name: CROSSDRAFT_TLS_CLIENT_CA_FILE
          value: /etc/crossdraft/tls/server/ca.crt
        - name: CROSSDRAFT_HEALTH_PORT
          value: {{ $root.Values.tls.healthPort | quote }}
        {{- end }}
        - name: CROSSDRAFT_HOME
          value: /models
        - name: HOME
          value: /tmp
        {{- include "crossdraft.hubEnv" . | nindent 8 }}
        {{- if $download }}
        - name: HF_HUB_OFFLINE
          value: "1"
        {{- end }}
        {{- with (include "crossdraft.otelEnv" . | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      startupProbe:
        grpc:
          # with TLS: the plaintext health-only port (the kubelet cannot present a client certificate)
          port: {{ ternary $root.Values.tls.healthPort $v.ports.grpc $root.Values.tls.enabled }}
          service: ""
        periodSeconds: {{ $v.startupProbe.periodSeconds }}
        failureThreshold: {{ $v.startupProbe.failureThreshold }}
        timeoutSeconds: {{ $v.startupProbe.timeoutSeconds }}
      readinessProbe:
        grpc:
          # with TLS: the plaintext health-only port (the kubelet cannot present a client certificate)
          port: {{ ternary $root.Values.tls.healthPort $v.ports.grpc $root.Values.tls.enabled }}
          service: ""
        periodSeconds: {{ $v.readinessProbe.periodSeconds }}
        failureThreshold: {{ $v.readinessProbe.failureThreshold }}
        timeoutSeconds: {{ $v.readinessProbe.timeoutSeconds }}
      livenessProbe:
        grpc:
          # with TLS: the plaintext health-only port (the kubelet cannot present a client certificate)
          port: {{ ternary $root.Values.tls.healthPort $v.ports.grpc $root.Values.tls.enabled }}
          service: ""
        periodSeconds: {{ $v.livenessProbe.periodSeconds }}
        failureThreshold: {{ $v.livenessProbe.failureThreshold }}
        timeoutSeconds: {{ $v.livenessProbe.timeoutSeconds }}
      resources:
        {{- include "crossdraft.gpuResources" $v | nindent 8 }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      volumeMounts:
        - name: models
          mountPath: /models
        - name: tmp
          mountPath: /tmp
        - name: dshm
          mountPath: /dev/shm
        {{- if $root.Values.tls.enabled }}
        - name: tls-server
          mountPath: /etc/crossdraft/tls/server
          readOnly: true
        {{- end }}
        {{- with (include "crossdraft.hubMounts" $root | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
  volumes:
    {{- if not (and (eq $comp "verifier") $v.modelCache.perPodClaim.enabled (not $v.modelCache.existingClaim)) }}
    {{- include "crossdraft.modelCacheVolume" $v.modelCache | nindent 4 }}
    {{- end }}
    - name: tmp
      emptyDir: {}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: 1Gi
    {{- if $root.Values.tls.enabled }}
    - name: tls-server
      secret:
        secretName: {{ include "crossdraft.tlsSecret" (list $root "modelServerSecret") }}
        defaultMode: 0440
    {{- end }}
    {{- with (include "crossdraft.hubVolumes" $root | trim) }}
    {{- . | nindent 4 }}
    {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/* Headless Service of a model server: include "crossdraft.modelServerService" (list $ "drafter" [values]). */}}
{{- define "crossdraft.modelServerService" -}}
{{- $root := index . 0 -}}
{{- $v := index $root.Values (index . 1) -}}
{{- if gt (len .) 2 }}{{ $v = index . 2 }}{{ end -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "crossdraft.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "crossdraft.labels" . | nindent 4 }}
spec:
  type: ClusterIP
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "crossdraft.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $v.ports.grpc }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ $v.ports.metrics }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
{{- end -}}

{{/* ServiceAccount without a mounted token: include "crossdraft.serviceAccount" (list $ "drafter" false). */}}
{{- define "crossdraft.serviceAccount" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $sa := (index $root.Values $comp).serviceAccount -}}
{{- $ctx := list $root $comp -}}
{{- if $sa.create }}
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ include "crossdraft.serviceAccountName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "crossdraft.labels" $ctx | nindent 4 }}
  {{- with $sa.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
automountServiceAccountToken: {{ index . 2 }}
{{- end }}
{{- end -}}
