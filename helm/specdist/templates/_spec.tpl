{{/* The specdist config (specdist/config.py) of these values: the ConfigMap's config.yaml and, in the RayService
     form, the Serve application's args.config (rayservice.yaml). One template, so the two cannot differ. */}}
{{- define "specdist.config" -}}
{{- $gpu := eq (include "specdist.useGpu" .) "true" -}}
target:
  model: {{ .Values.model.target | quote }}
  dtype: {{ .Values.target.dtype }}
  weights: {{ .Values.target.weights }}
draft:
  method: {{ .Values.draft.method }}
  model: {{ if .Values.model.draft }}{{ .Values.model.draft | quote }}{{ else }}null{{ end }}
  dtype: {{ .Values.draft.dtype | default "float32" }}
  num_speculative_tokens: {{ .Values.draft.numSpeculativeTokens | default 4 | int }}
  {{- with .Values.draft.lengthPolicy }}
  length_policy: {{ . }}
  {{- end }}
  confidence_threshold: {{ .Values.draft.confidenceThreshold | default 0 | float64 }}
  ngram_min: {{ .Values.draft.ngramMin | default 1 | int }}
  ngram_max: {{ .Values.draft.ngramMax | default 3 | int }}
  {{- /* required by the schema and rendered as set: 0 is a valid value of most of them (no `default`) */}}
  suffix_max_depth: {{ .Values.draft.suffixMaxDepth | int }}
  suffix_min_prob: {{ include "specdist.yamlFloat" .Values.draft.suffixMinProb }}
  suffix_max_spec_factor: {{ include "specdist.yamlFloat" .Values.draft.suffixMaxSpecFactor }}
  suffix_cache_requests: {{ .Values.draft.suffixCacheRequests | int }}
  suffix_cache_tokens: {{ .Values.draft.suffixCacheTokens | default 262144 | int }}
  suffix_scope: {{ .Values.draft.suffixScope | default "tenant" }}
  suffix_min_score: {{ include "specdist.yamlFloat" .Values.draft.suffixMinScore }}
  pipeline: {{ .Values.draft.pipeline | default false }}
  pipeline_miss: {{ .Values.draft.pipelineMiss | default "redraft" }}
  q_top_k: {{ .Values.draft.qTopK | default 0 | int }}
  {{- range $key, $value := .Values.draft.settings }}
  {{ $key | quote }}: {{ $value | toJson }}
  {{- end }}
sampling:
  coupling: {{ .Values.sampling.coupling | default "gumbel" }}
engine:
  max_model_len: {{ .Values.engine.maxModelLen | default 2048 | int }}
  max_batch_size: {{ .Values.engine.maxBatchSize | default 8 | int }}
  max_prefill_tokens: {{ if .Values.engine.maxPrefillTokens }}{{ .Values.engine.maxPrefillTokens | int }}{{ else }}null{{ end }}
  device: auto
  num_threads: {{ if .Values.engine.numThreads }}{{ .Values.engine.numThreads | int }}{{ else }}null{{ end }}
  seed: {{ if kindIs "invalid" .Values.engine.seed }}null{{ else }}{{ .Values.engine.seed | int64 }}{{ end }}
  compile: {{ if kindIs "bool" .Values.engine.compile }}{{ .Values.engine.compile }}{{ else }}{{ .Values.engine.compile | default "auto" }}{{ end }}
  compile_cache_dir: {{ if .Values.engine.compileCacheDir }}{{ .Values.engine.compileCacheDir | quote }}{{ else }}null{{ end }}
  prefix_caching: {{ ternary true false (ne .Values.engine.prefixCaching false) }}
  prefix_cache_scope: {{ .Values.engine.prefixCacheScope | default "tenant" }}
  kv_cache_dtype: {{ .Values.engine.kvCacheDtype | default "auto" }}
  cpu_kernels: {{ .Values.engine.cpuKernels | default "auto" }}
  kv_cache: {{ .Values.engine.kvCache | default "auto" }}
  attention_backend: {{ .Values.engine.attentionBackend | default "auto" | quote }}
  kv_block_size: {{ .Values.engine.kvBlockSize | default 16 | int }}
  kv_cache_tokens: {{ if .Values.engine.kvCacheTokens }}{{ .Values.engine.kvCacheTokens | int }}{{ else }}null{{ end }}
  gpu_memory_utilization: {{ include "specdist.yamlFloat" (.Values.engine.gpuMemoryUtilization | default 0.9) }}
  cuda_graphs: {{ if kindIs "bool" .Values.engine.cudaGraphs }}{{ .Values.engine.cudaGraphs }}{{ else }}{{ .Values.engine.cudaGraphs | default "auto" }}{{ end }}
cluster:
  enabled: true
  tensor_parallel_size: {{ .Values.target.tensorParallelSize | int }}
  num_draft_workers: {{ .Values.draft.replicas | int }}
  cpus_per_rank: {{ .Values.target.cpusPerRank | float64 }}
  cpus_per_draft: {{ .Values.draft.cpusPerReplica | float64 }}
  {{- if $gpu }}
  gpus_per_draft: {{ .Values.draft.gpusPerReplica | default 1 | float64 }}
  {{- end }}
  use_gpu: {{ $gpu }}
  pin_cpus: {{ .Values.engine.pinCpus | default false }}
  bringup_timeout_s: {{ .Values.serve.bringupTimeoutSeconds | float64 }}
  {{- with .Values.serve.faults }}
  max_restarts: {{ .maxRestarts | int }}
  health_interval_s: {{ .healthIntervalSeconds | float64 }}
  health_timeout_s: {{ .healthTimeoutSeconds | float64 }}
  rebuild_attempts: {{ .rebuildAttempts | int }}
  collective_timeout_s: {{ .collectiveTimeoutSeconds | float64 }}
  {{- end }}
  {{- $r := .Values.replicas }}
  {{- if kindIs "map" $r }}
  replicas:
    min: {{ $r.min | int }}
    max: {{ (hasKey $r "max" | ternary $r.max $r.min) | int }}
    {{- if hasKey $r "targetOngoingRequests" }}
    target_ongoing_requests: {{ if kindIs "invalid" $r.targetOngoingRequests }}null{{ else }}{{ include "specdist.yamlFloat" $r.targetOngoingRequests }}{{ end }}
    {{- end }}
    {{- if hasKey $r "upscaleDelaySeconds" }}
    upscale_delay_s: {{ include "specdist.yamlFloat" $r.upscaleDelaySeconds }}
    {{- end }}
    {{- if hasKey $r "downscaleDelaySeconds" }}
    downscale_delay_s: {{ include "specdist.yamlFloat" $r.downscaleDelaySeconds }}
    {{- end }}
  {{- else if kindIs "invalid" $r }}
  replicas: null
  {{- else }}
  replicas: {{ $r | int }}
  {{- end }}
{{- with .Values.router }}
router:
  policy: {{ .policy | quote }}
  imbalance_threshold:
    absolute: {{ .imbalanceThreshold.absolute | int }}
    relative: {{ include "specdist.yamlFloat" .imbalanceThreshold.relative }}
  stats_period_s: {{ include "specdist.yamlFloat" .statsPeriodSeconds }}
  session_blocks: {{ .sessionBlocks | int }}
{{- end }}
{{- with .Values.limits }}
limits:
  max_message_bytes: {{ .maxMessageBytes | int64 }}
  max_prompt_chars: {{ if .maxPromptChars }}{{ .maxPromptChars | int64 }}{{ else }}null{{ end }}
  max_prompt_tokens: {{ if .maxPromptTokens }}{{ .maxPromptTokens | int64 }}{{ else }}null{{ end }}
  max_tokens: {{ if .maxTokens }}{{ .maxTokens | int64 }}{{ else }}null{{ end }}
  max_stop: {{ .maxStop | int64 }}
  max_stop_chars: {{ .maxStopChars | int64 }}
  max_stop_token_ids: {{ .maxStopTokenIds | int64 }}
  max_request_id_chars: {{ .maxRequestIdChars | int64 }}
  max_n: {{ .maxN | int64 }}
  speculative_stats: {{ ternary true false (ne .speculativeStats false) }}
  max_queued_per_tenant: {{ if .maxQueuedPerTenant }}{{ .maxQueuedPerTenant | int64 }}{{ else }}null{{ end }}
  max_messages: {{ .maxMessages | int64 }}
  max_logprob_entries: {{ .maxLogprobEntries | int64 }}
  http_idle_timeout_s: {{ include "specdist.yamlFloat" .httpIdleTimeoutSeconds }}
  http_write_timeout_s: {{ include "specdist.yamlFloat" .httpWriteTimeoutSeconds }}
  http_connections_per_peer: {{ if .httpConnectionsPerPeer }}{{ .httpConnectionsPerPeer | int64 }}{{ else }}null{{ end }}
{{- end }}
{{- end -}}

{{/* The RayCluster spec: the RayCluster form's spec (raycluster.yaml) and the RayService's rayClusterConfig
     (rayservice.yaml). */}}
{{- define "specdist.rayClusterSpec" -}}
{{- $full := include "specdist.fullname" . -}}
{{- $gpu := eq (include "specdist.useGpu" .) "true" -}}
{{- $cfgDir := include "specdist.configDir" . -}}
{{- $port := int .Values.serve.port -}}
{{- $tls := not (empty .Values.serve.tls.secretName) -}}
{{- /* The startup probe covers waiting for the worker pods, the bring-up (load + warm-up) and a margin. */ -}}
{{- $startupBudget := add (int .Values.serve.workerWaitSeconds) (int .Values.serve.bringupTimeoutSeconds) 120 -}}
rayVersion: {{ .Values.rayVersion | quote }}
enableInTreeAutoscaling: false
# A changed spec (a new config, image or shape) recreates every pod: the deployment's shape is fixed
# at bring-up (one placement group per draft), so draft scaling is a restart of the whole deployment.
upgradeStrategy:
  type: Recreate
{{- if eq .Values.ray.auth.mode "token" }}
authOptions:
  mode: token
  {{- with .Values.ray.auth.secretName }}
  secretName: {{ . }}
  {{- end }}
{{- end }}
headGroupSpec:
  # KubeRay's default, made explicit: the workers reach the head's GCS through this Service while the
  # head pod is not Ready yet (it turns Ready only once specdist serves, after the workers joined).
  headService:
    spec:
      clusterIP: None
      publishNotReadyAddresses: true
  # Nothing of the deployment runs on the head but the public server: no Ray CPUs/GPUs to schedule on.
  rayStartParams:
    num-cpus: "0"
    num-gpus: "0"
  template:
    metadata:
      labels:
        {{- include "specdist.podLabels" . | nindent 8 }}
        specdist.io/role: head
      annotations:
        # The container below starts Ray itself ($KUBERAY_GEN_RAY_START_CMD), then specdist serve.
        ray.io/overwrite-container-cmd: "true"
        checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
    spec:
      # SIGTERM: specdist serve drains (--drain-seconds), then stops the actors and placement groups.
      terminationGracePeriodSeconds: {{ include "specdist.gracePeriod" . }}
      {{- include "specdist.podSecurity" . | nindent 6 }}
      {{- with (include "specdist.scheduling" (dict "v" .Values.head "root" $) | trim) }}
      {{- . | nindent 6 }}
      {{- end }}
      containers:
        - name: ray-head
          image: {{ include "specdist.image" . }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          command: ["/bin/bash", "-c", "--"]
          args:
            - |-
              ulimit -n 65536
              /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &
              python {{ $cfgDir }}/wait_for_workers.py --workers {{ include "specdist.expectedWorkers" . }} --timeout {{ .Values.serve.workerWaitSeconds | int }}
              exec specdist serve --config {{ $cfgDir }}/config.yaml --host 0.0.0.0 --port {{ $port }} --max-queued {{ .Values.serve.maxQueued | default 256 | int }} --drain-seconds {{ .Values.serve.drainSeconds | int }} --ray-address auto --worker-host {{ .Values.serve.workerHost }}{{ include "specdist.serveExtraArgs" . }}
          env:
            {{- include "specdist.env" . | trim | nindent 12 }}
          ports:
            - name: gcs-server
              containerPort: 6379
            - name: dashboard
              containerPort: 8265
            - name: client
              containerPort: 10001
            - name: grpc
              containerPort: {{ $port }}
              protocol: TCP
            {{- if .Values.serve.http.enabled }}
            - name: http
              containerPort: {{ .Values.serve.http.port | int }}
              protocol: TCP
            {{- end }}
            {{- if .Values.metrics.enabled }}
            - name: http-metrics
              containerPort: {{ .Values.metrics.port | int }}
              protocol: TCP
            {{- end }}
          # gRPC health (grpc.health.v1). "" is the server, specdist.v1.SpecDecode the API: both turn SERVING
          # after the warm-up, NOT_SERVING when the drain starts and while the target group rebuilds (minutes).
          # specdist.v1.Liveness (specdist.transport.grpc_host.LIVENESS) is SERVING from the moment the port opens
          # while the process and its event loop answer, until the server stops. So: startup waits for ""
          # (the bring-up and the warm-up, within the startup budget), readiness follows the API (the
          # Service stops routing to a draining or rebuilding server), liveness asks Liveness, so that a
          # rebuild does not get the head restarted in the middle of it. With TLS: exec probes
          # (specdist.probe in _helpers.tpl), which start a Python process: hence the longer timeouts.
          startupProbe:
            {{- include "specdist.probe" (dict "root" $ "service" "" "timeout" (ternary 10 1 $tls)) | nindent 12 }}
            periodSeconds: 10
            failureThreshold: {{ div $startupBudget 10 | add 1 }}
          readinessProbe:
            {{- include "specdist.probe" (dict "root" $ "service" "specdist.v1.SpecDecode" "timeout" (ternary 5 3 $tls)) | nindent 12 }}
            periodSeconds: 5
            failureThreshold: 2
          livenessProbe:
            {{- include "specdist.probe" (dict "root" $ "service" "specdist.v1.Liveness" "timeout" (ternary 10 5 $tls)) | nindent 12 }}
            periodSeconds: 10
            failureThreshold: 6
          resources:
            {{- toYaml (default dict .Values.head.resources) | nindent 12 }}
          {{- include "specdist.containerSecurity" . | nindent 10 }}
          volumeMounts:
            - name: specdist-config
              mountPath: {{ $cfgDir }}
              readOnly: true
            {{- include "specdist.writableMounts" . | nindent 12 }}
            {{- with (include "specdist.modelVolumeMount" . | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with (include "specdist.secretVolumeMounts" . | trim) }}
            {{- . | nindent 12 }}
            {{- end }}
      volumes:
        - name: specdist-config
          configMap:
            name: {{ $full }}
        {{- include "specdist.writableVolumes" . | nindent 8 }}
        {{- with (include "specdist.modelVolume" . | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with (include "specdist.secretVolumes" . | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
workerGroupSpecs:
  # The tensor-parallel target: ONE pod holding every rank (cluster/placement.py packs the ranks
  # on one node), so the pod offers tensorParallelSize GPUs, or the ranks' CPUs.
  - groupName: target
    replicas: 1
    minReplicas: 1
    maxReplicas: 1
    rayStartParams:
      num-cpus: {{ mulf .Values.target.tensorParallelSize .Values.target.cpusPerRank | ceil | int | quote }}
      num-gpus: {{ .Values.target.gpusPerPod | int | quote }}
    template:
      metadata:
        labels:
          {{- include "specdist.podLabels" . | nindent 10 }}
          specdist.io/role: target
      spec:
        {{- include "specdist.podSecurity" . | nindent 8 }}
        {{- with (include "specdist.scheduling" (dict "v" .Values.target "root" $) | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        containers:
          - name: ray-worker
            image: {{ include "specdist.image" . }}
            imagePullPolicy: {{ .Values.image.pullPolicy }}
            env:
              {{- include "specdist.env" . | trim | nindent 14 }}
            resources:
              {{- include "specdist.resources" (dict "v" .Values.target "gpus" .Values.target.gpusPerPod "root" $) | nindent 14 }}
            {{- include "specdist.containerSecurity" . | nindent 12 }}
            {{- include "specdist.workerProbes" . | nindent 12 }}
            volumeMounts:
              {{- include "specdist.writableMounts" . | nindent 14 }}
              {{- with (include "specdist.modelVolumeMount" . | trim) }}
              {{- . | nindent 14 }}
              {{- end }}
        volumes:
          {{- include "specdist.writableVolumes" . | nindent 10 }}
          {{- with (include "specdist.modelVolume" . | trim) }}
          {{- . | nindent 10 }}
          {{- end }}
  {{- if gt (int .Values.draft.replicas) 0 }}
  # The draft workers: one pod per replica, one draft worker actor each.
  - groupName: draft
    replicas: {{ .Values.draft.replicas | int }}
    minReplicas: {{ .Values.draft.replicas | int }}
    maxReplicas: {{ .Values.draft.replicas | int }}
    rayStartParams:
      num-cpus: {{ .Values.draft.cpusPerReplica | ceil | int | quote }}
      num-gpus: {{ .Values.draft.gpusPerReplica | int | quote }}
    template:
      metadata:
        labels:
          {{- include "specdist.podLabels" . | nindent 10 }}
          specdist.io/role: draft
      spec:
        {{- include "specdist.podSecurity" . | nindent 8 }}
        {{- with (include "specdist.scheduling" (dict "v" .Values.draft "root" $) | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        containers:
          - name: ray-worker
            image: {{ include "specdist.image" . }}
            imagePullPolicy: {{ .Values.image.pullPolicy }}
            env:
              {{- include "specdist.env" . | trim | nindent 14 }}
            resources:
              {{- include "specdist.resources" (dict "v" .Values.draft "gpus" .Values.draft.gpusPerReplica "root" $) | nindent 14 }}
            {{- include "specdist.containerSecurity" . | nindent 12 }}
            {{- include "specdist.workerProbes" . | nindent 12 }}
            volumeMounts:
              {{- include "specdist.writableMounts" . | nindent 14 }}
              {{- with (include "specdist.modelVolumeMount" . | trim) }}
              {{- . | nindent 14 }}
              {{- end }}
        volumes:
          {{- include "specdist.writableVolumes" . | nindent 10 }}
          {{- with (include "specdist.modelVolume" . | trim) }}
          {{- . | nindent 10 }}
          {{- end }}
  {{- end }}
{{- end -}}
