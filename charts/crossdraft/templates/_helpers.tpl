{{/* Chart name. */}}
{{- define "crossdraft.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name prefix: <release>-<chart> unless the release name already contains the chart name. */}}
{{- define "crossdraft.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: include "crossdraft.componentName" (list $ "drafter"). */}}
{{- define "crossdraft.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "crossdraft.fullname" $root | trunc 50 | trimSuffix "-") (index . 1) -}}
{{- end -}}

{{- define "crossdraft.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object: include "crossdraft.labels" (list $ "drafter"). */}}
{{- define "crossdraft.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ include "crossdraft.chart" $root }}
{{ include "crossdraft.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: crossdraft
{{- with $root.Values.global.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels: include "crossdraft.selectorLabels" (list $ "drafter"). */}}
{{- define "crossdraft.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "crossdraft.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Image reference: include "crossdraft.image" (list $ .Values.drafter.image). */}}
{{- define "crossdraft.image" -}}
{{- $root := index . 0 -}}
{{- $img := index . 1 -}}
{{- printf "%s:%s" $img.repository (default $root.Chart.AppVersion (toString $img.tag)) -}}
{{- end -}}

{{- define "crossdraft.pullPolicy" -}}
{{- $root := index . 0 -}}
{{- $img := index . 1 -}}
{{- default $root.Values.global.imagePullPolicy $img.pullPolicy -}}
{{- end -}}

{{/* ServiceAccount name: include "crossdraft.serviceAccountName" (list $ "drafter"). */}}
{{- define "crossdraft.serviceAccountName" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $sa := (index $root.Values $comp).serviceAccount -}}
{{- if $sa.create -}}
{{- default (include "crossdraft.componentName" .) $sa.name -}}
{{- else -}}
{{- default "default" $sa.name -}}
{{- end -}}
{{- end -}}

{{- define "crossdraft.modelsConfigName" -}}
{{- include "crossdraft.componentName" (list . "models") -}}
{{- end -}}
{{- define "crossdraft.gatewayConfigName" -}}
{{- include "crossdraft.componentName" (list . "gateway-config") -}}
{{- end -}}

{{/* Headless Service names, shared by the model servers and the gateway's discovery env. */}}
{{- define "crossdraft.drafterService" -}}
{{- include "crossdraft.componentName" (list . "drafter") -}}
{{- end -}}
{{- define "crossdraft.verifierService" -}}
{{- include "crossdraft.componentName" (list . "verifier") -}}
{{- end -}}
{{- define "crossdraft.redisService" -}}
{{- include "crossdraft.componentName" (list . "redis") -}}
{{- end -}}

{{/* Deep merge of src into dst, in place (dst must be a copy): include "crossdraft.mergeInto" (list $dst $src).
Unlike mergeOverwrite, a false, 0 or "" in src wins too. */}}
{{- define "crossdraft.mergeInto" -}}
{{- $dst := index . 0 -}}
{{- range $k, $val := index . 1 -}}
{{- if and (kindIs "map" $val) (kindIs "map" (index $dst $k)) -}}
{{- include "crossdraft.mergeInto" (list (index $dst $k) $val) -}}
{{- else -}}
{{- $_ := set $dst $k (and $val (deepCopy $val)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The drafter kinds, in order: the drafter block (component "drafter"), then one per drafters entry
(component "drafter-<name>"). Sets $out.kinds and $out.pool (the entries only) to lists of
dict(name, comp, service, values, ctx) -- ctx is what the model-server helpers take:
  {{- $k := dict -}}{{- $_ := include "crossdraft.drafterKinds" (list $ $k) -}}
An entry's values are the drafter block's with the entry's fields over them: Kubernetes objects
(resources, nodeSelector, affinity, securityContexts, pod labels/annotations) and lists replace the
drafter's, the settings blocks (image, ports, gpu, batching, modelCache, probes, autoscaling, pdb)
are merged key by key; revision, modelFile and trustRemoteCode belong to a model and are not inherited.
*/}}
{{- define "crossdraft.drafterKinds" -}}
{{- $root := index . 0 -}}
{{- $out := index . 1 -}}
{{- $kinds := list (dict "name" "" "comp" "drafter" "service" (include "crossdraft.drafterService" $root)
      "values" $root.Values.drafter "ctx" (list $root "drafter")) -}}
{{- $pool := list -}}
{{- $seen := dict -}}
{{- $replaced := list "resources" "nodeSelector" "affinity" "podSecurityContext" "securityContext" "podAnnotations" "podLabels" -}}
{{- range $i, $e := $root.Values.drafters | default list -}}
{{- $name := toString (required (printf "drafters[%d].name is required" $i) $e.name) -}}
{{- if not (regexMatch "^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$" $name) -}}
{{- fail (printf "drafters[%d].name %q: lowercase letters, digits and '-', 1-40 characters, starting and ending with a letter or digit" $i $name) -}}
{{- end -}}
{{- if hasKey $seen $name -}}
{{- fail (printf "drafters[%d].name %q: two drafters entries have this name" $i $name) -}}
{{- end -}}
{{- $_ := set $seen $name true -}}
{{- $_ := required (printf "drafters[%d].model is required (drafter %q)" $i $name) $e.model -}}
{{- $comp := printf "drafter-%s" $name -}}
{{- $svc := include "crossdraft.componentName" (list $root $comp) -}}
{{- if gt (len $svc) 63 -}}
{{- fail (printf "drafters[%d]: the Service name %q is longer than 63 characters: shorten the name (or fullnameOverride)" $i $svc) -}}
{{- end -}}
{{- $v := deepCopy $root.Values.drafter -}}
{{- $_ := set $v "revision" "" -}}
{{- $_ := set $v "modelFile" "" -}}
{{- $_ := set $v "trustRemoteCode" false -}}
{{- range $k, $val := omit $e "name" -}}
{{- if has $k $replaced -}}
{{- $_ := set $v $k (and $val (deepCopy $val)) -}}
{{- else -}}
{{- include "crossdraft.mergeInto" (list $v (dict $k $val)) -}}
{{- end -}}
{{- end -}}
{{- $kind := dict "name" $name "comp" $comp "service" $svc "values" $v "ctx" (list $root $comp $v) -}}
{{- $kinds = append $kinds $kind -}}
{{- $pool = append $pool $kind -}}
{{- end -}}
{{- $_ := set $out "kinds" $kinds -}}
{{- $_ := set $out "pool" $pool -}}
{{- end -}}

{{- define "crossdraft.redisExternal" -}}
{{- if .Values.redis.external.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* OTEL_* env, rendered only when otel.endpoint is set: include "crossdraft.otelEnv" (list $ "drafter"). */}}
{{- define "crossdraft.otelEnv" -}}
{{- $root := index . 0 -}}
{{- with $root.Values.otel }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" .serviceNamePrefix (index $ 1) | quote }}
{{- if .protocol }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .protocol | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* /models volume: include "crossdraft.modelCacheVolume" .Values.drafter.modelCache. */}}
{{- define "crossdraft.modelCacheVolume" -}}
- name: models
{{- if .existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .existingClaim }}
{{- else if .sizeLimit }}
  emptyDir:
    sizeLimit: {{ .sizeLimit }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* GPU-aware resources: include "crossdraft.gpuResources" .Values.drafter. */}}
{{- define "crossdraft.gpuResources" -}}
{{- $res := deepCopy (default dict .resources) -}}
{{- if gt (int .gpu.count) 0 -}}
{{- $req := default dict $res.requests -}}
{{- $lim := default dict $res.limits -}}
{{- $_ := set $req .gpu.resourceName (int .gpu.count) -}}
{{- $_ := set $lim .gpu.resourceName (int .gpu.count) -}}
{{- $_ := set $res "requests" $req -}}
{{- $_ := set $res "limits" $lim -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* PodDisruptionBudget body: include "crossdraft.pdb" (list $ "drafter" [values]); values default to .Values.<comp>. */}}
{{- define "crossdraft.pdb" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $v := index $root.Values $comp -}}
{{- if gt (len .) 2 }}{{ $v = index . 2 }}{{ end -}}
{{- $pdb := $v.pdb -}}
{{- if $pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "crossdraft.componentName" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "crossdraft.labels" . | nindent 4 }}
spec:
  {{- if ne (toString $pdb.minAvailable) "" }}
  minAvailable: {{ $pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ $pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "crossdraft.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* HPA: include "crossdraft.hpa" (list $ "drafter" "Deployment" [values]); values default to .Values.<comp>. */}}
{{- define "crossdraft.hpa" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $v := index $root.Values $comp -}}
{{- if gt (len .) 3 }}{{ $v = index . 3 }}{{ end -}}
{{- $as := $v.autoscaling -}}
{{- $ctx := list $root $comp -}}
{{- if $as.enabled }}
{{- if and (not $as.targetCPUUtilizationPercentage) (not $as.customMetric.name) }}
{{- fail (printf "%s.autoscaling: set targetCPUUtilizationPercentage or customMetric.name" $comp) }}
{{- end }}
{{- if gt (int $as.minReplicas) (int $as.maxReplicas) }}
{{- fail (printf "%s.autoscaling: minReplicas > maxReplicas" $comp) }}
{{- end }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "crossdraft.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "crossdraft.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: {{ index . 2 }}
    name: {{ include "crossdraft.componentName" $ctx }}
  minReplicas: {{ $as.minReplicas }}
  maxReplicas: {{ $as.maxReplicas }}
  metrics:
    {{- if $as.targetCPUUtilizationPercentage }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $as.targetCPUUtilizationPercentage }}
    {{- end }}
    {{- if $as.customMetric.name }}
    - type: Pods
      pods:
        metric:
          name: {{ $as.customMetric.name }}
        target:
          type: AverageValue
          averageValue: {{ $as.customMetric.targetAverageValue | quote }}
    {{- end }}
{{- end }}
{{- end -}}

{{/* "true" when a model spec is a Hugging Face Hub id, org/name[:QUANT][@revision][:QUANT] (else empty):
include "crossdraft.isHubId" .Values.drafter.model. Local HF directories are absolute paths. */}}
{{- define "crossdraft.isHubId" -}}
{{- if regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(:[A-Za-z0-9][A-Za-z0-9._-]*)?(@[^\\s@:]+)?(:[A-Za-z0-9][A-Za-z0-9._-]*)?$" (toString .) -}}true{{- end -}}
{{- end -}}

{{/* Claim of the shared Hub cache (hub.cache), or empty: include "crossdraft.hfCacheClaim" $. */}}
{{- define "crossdraft.hfCacheClaim" -}}
{{- if .Values.hub.cache.existingClaim -}}
{{- .Values.hub.cache.existingClaim -}}
{{- else if .Values.hub.cache.create.enabled -}}
{{- include "crossdraft.componentName" (list . "hf-cache") -}}
{{- end -}}
{{- end -}}

{{/* HF_HOME of the model servers: the shared claim, else inside the pod's /models cache. */}}
{{- define "crossdraft.hfHome" -}}
{{- if include "crossdraft.hfCacheClaim" . -}}/hf-cache{{- else -}}/models/huggingface{{- end -}}
{{- end -}}

{{/* Env of a model server and of its download init container for Hub ids (revision, GGUF file, token, cache):
include "crossdraft.hubEnv" (list $ "drafter" [values]). The token only ever comes from the Secret. */}}
{{- define "crossdraft.hubEnv" -}}
{{- $root := index . 0 -}}
{{- $comp := index . 1 -}}
{{- $v := index $root.Values $comp -}}
{{- if gt (len .) 2 }}{{ $v = index . 2 }}{{ end -}}
{{- $hub := $root.Values.hub -}}
- name: HF_HOME
  value: {{ include "crossdraft.hfHome" $root | quote }}
- name: HF_HUB_DISABLE_TELEMETRY
  value: "1"
{{- if $v.revision }}
- name: CROSSDRAFT_REVISION
  valueFrom:
    configMapKeyRef:
      name: {{ include "crossdraft.modelsConfigName" $root }}
      key: {{ $comp }}-revision
{{- end }}
{{- if $v.modelFile }}
- name: CROSSDRAFT_MODEL_FILE
  valueFrom:
    configMapKeyRef:
      name: {{ include "crossdraft.modelsConfigName" $root }}
      key: {{ $comp }}-model-file
{{- end }}
{{- if $v.trustRemoteCode }}
- name: CROSSDRAFT_TRUST_REMOTE_CODE
  value: "true"
{{- end }}
{{- with $hub.endpoint }}
- name: HF_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- if $hub.hfTokenSecret.name }}
{{- if eq $hub.hfTokenSecret.mountAs "env" }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $hub.hfTokenSecret.name }}
      key: {{ $hub.hfTokenSecret.key }}
{{- else }}
- name: HF_TOKEN_PATH
  value: /var/run/secrets/huggingface/token
{{- end }}
{{- end }}
{{- end -}}

{{/* Mounts of the shared Hub cache and of the token file, when used: include "crossdraft.hubMounts" $. */}}
{{- define "crossdraft.hubMounts" -}}
{{- if include "crossdraft.hfCacheClaim" . }}
- name: hf-cache
  mountPath: /hf-cache
{{- end }}
{{- if and .Values.hub.hfTokenSecret.name (eq .Values.hub.hfTokenSecret.mountAs "file") }}
- name: hf-token
  mountPath: /var/run/secrets/huggingface
  readOnly: true
{{- end }}
{{- end -}}

{{/* Volumes behind crossdraft.hubMounts: include "crossdraft.hubVolumes" $. */}}
{{- define "crossdraft.hubVolumes" -}}
{{- with include "crossdraft.hfCacheClaim" . }}
- name: hf-cache
  persistentVolumeClaim:
    claimName: {{ . }}
{{- end }}
{{- if and .Values.hub.hfTokenSecret.name (eq .Values.hub.hfTokenSecret.mountAs "file") }}
- name: hf-token
  secret:
    secretName: {{ .Values.hub.hfTokenSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ .Values.hub.hfTokenSecret.key }}
        path: token
{{- end }}
{{- end -}}

{{/* TLS (tls.*): the name the gateway checks in the model servers' certificate. */}}
{{- define "crossdraft.modelServerName" -}}
{{- .Values.tls.modelServerName | default (printf "%s-modelserver" (include "crossdraft.fullname" .)) -}}
{{- end -}}

{{/* A required TLS Secret name: include "crossdraft.tlsSecret" (list $ "gatewaySecret"). */}}
{{- define "crossdraft.tlsSecret" -}}
{{- $root := index . 0 -}}
{{- $key := index . 1 -}}
{{- required (printf "tls.%s is required with tls.enabled (an existing Secret with tls.crt, tls.key, ca.crt)" $key) (index $root.Values.tls $key) -}}
{{- end -}}

