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
     (rayservice.yaml). The two forms share the head's image, security, Secrets, ports and scheduling; they differ in
     what the head runs (`specdist serve`, or Ray alone: KubeRay deploys the Serve application onto it), its probes
     and the worker groups (target + draft, or one `replica` pod a Serve replica). */}}
{{- define "specdist.rayClusterSpec" -}}
{{- $svc := eq (include "specdist.rayService" .) "true" -}}
{{- $full := include "specdist.fullname" . -}}
{{- $gpu := eq (include "specdist.useGpu" .) "true" -}}
{{- $cfgDir := include "specdist.configDir" . -}}
{{- $port := int .Values.serve.port -}}
{{- $tls := not (empty .Values.serve.tls.secretName) -}}
{{- /* The startup probe covers waiting for the worker pods, the bring-up (load + warm-up) and a margin. */ -}}
{{- $startupBudget := add (int .Values.serve.workerWaitSeconds) (int .Values.serve.bringupTimeoutSeconds) 120 -}}
rayVersion: {{ .Values.rayVersion | quote }}
enableInTreeAutoscaling: false
{{- if not $svc }}
# A changed spec (a new config, image or shape) recreates every pod: the deployment's shape is fixed
# at bring-up (one placement group per draft), so draft scaling is a restart of the whole deployment.
upgradeStrategy:
  type: Recreate
{{- end }}
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
  # Nothing of the deployment runs on the head but the public server: no Ray CPUs/GPUs to schedule on. In the
  # RayService form the front doors (Serve deployment SpecdistFront) run here: build_app's front_resource makes
  # them ask for this one unit, so that they land on the pod the Service reaches; they take no CPU.
  rayStartParams:
    num-cpus: "0"
    num-gpus: "0"
    {{- if $svc }}
    resources: {{ printf "{\"%s\": 1}" (include "specdist.frontResource" .) | quote | quote }}
    {{- end }}
  template:
    metadata:
      labels:
        {{- include "specdist.podLabels" . | nindent 8 }}
        specdist.io/role: head
      annotations:
        # The container below starts Ray itself ($KUBERAY_GEN_RAY_START_CMD), then specdist serve (RayService
        # form: waits for the replica pods, then for Ray).
        ray.io/overwrite-container-cmd: "true"
        checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
        {{- if $svc }}
        # Any change of the Serve config changes the cluster spec too, so KubeRay upgrades by a new cluster
        # (zero downtime) and never redeploys the application in place (the front's fixed ports would close).
        checksum/serve-config: {{ include "specdist.serveConfig" . | sha256sum }}
        {{- end }}
    spec:
      {{- if not $svc }}
      # SIGTERM: specdist serve drains (--drain-seconds), then stops the actors and placement groups.
      {{- end }}
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
            {{- if $svc }}
            # The head turns Ready (readinessProbe: the marker) once every replica pod joined Ray: KubeRay submits
            # the Serve config only to a Ready head, and build_app checks that the replicas fit the live nodes.
            - |-
              ulimit -n 65536
              /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &
              ray_pid=$!
              trap 'kill -TERM "$ray_pid"' TERM
              python {{ $cfgDir }}/wait_for_workers.py --workers {{ include "specdist.replicasMax" . }} --timeout {{ .Values.serve.workerWaitSeconds | int }}
              touch {{ include "specdist.joinedMarker" . }}
              wait "$ray_pid"
            {{- else }}
            - |-
              ulimit -n 65536
              /bin/bash -c "$KUBERAY_GEN_RAY_START_CMD" &
              python {{ $cfgDir }}/wait_for_workers.py --workers {{ include "specdist.expectedWorkers" . }} --timeout {{ .Values.serve.workerWaitSeconds | int }}
              exec specdist serve --config {{ $cfgDir }}/config.yaml --host 0.0.0.0 --port {{ $port }} --max-queued {{ .Values.serve.maxQueued | default 256 | int }} --drain-seconds {{ .Values.serve.drainSeconds | int }} --ray-address auto --worker-host {{ .Values.serve.workerHost }}{{ include "specdist.serveExtraArgs" . }}
            {{- end }}
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
          {{- if $svc }}
          # RayService form: the head runs Ray, Serve's controller and the front doors. Readiness: every replica pod
          # has joined (the marker of the command above); not the front's health, which comes up only after
          # KubeRay, waiting for a Ready head, submits the Serve config. Which head the Service reaches is
          # KubeRay's: the active cluster's, switched only once its application runs. Liveness: the raylet.
          readinessProbe:
            exec:
              command: ["test", "-e", {{ include "specdist.joinedMarker" . | quote }}]
            periodSeconds: 5
            timeoutSeconds: 2
            failureThreshold: 1
          livenessProbe:
            httpGet:
              path: /api/local_raylet_healthz
              port: 52365
            initialDelaySeconds: 30
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 60
          {{- else }}
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
          {{- end }}
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
  {{- if $svc }}
  # RayService form: one pod a Serve replica, holding its whole speculative group (cluster/placement.py
  # replica_bundles: the replica's own bundle, every target rank and every draft, STRICT_PACK with tensor
  # parallelism), so Serve places, restarts, scales and drains a group as one. replicas.max pods from the start
  # (no in-tree autoscaler): Serve's autoscaler starts and drains replicas on them between min and max.
  - groupName: replica
    replicas: {{ include "specdist.replicasMax" . }}
    minReplicas: {{ include "specdist.replicasMax" . }}
    maxReplicas: {{ include "specdist.replicasMax" . }}
    rayStartParams:
      num-cpus: {{ include "specdist.replicaCpus" . | quote }}
      num-gpus: {{ include "specdist.replicaGpus" . | quote }}
    template:
      metadata:
        labels:
          {{- include "specdist.podLabels" . | nindent 10 }}
          specdist.io/role: replica
      spec:
        {{- include "specdist.podSecurity" . | nindent 8 }}
        {{- with (include "specdist.scheduling" (dict "v" .Values.replicaPod "root" $) | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        containers:
          - name: ray-worker
            image: {{ include "specdist.image" . }}
            imagePullPolicy: {{ .Values.image.pullPolicy }}
            env:
              {{- include "specdist.env" . | trim | nindent 14 }}
            resources:
              {{- include "specdist.resources" (dict "v" .Values.replicaPod "gpus" (include "specdist.replicaGpus" .) "root" $) | nindent 14 }}
            {{- include "specdist.containerSecurity" . | nindent 12 }}
            {{- /* our own probes: KubeRay would otherwise inject a readiness check of a Serve proxy on this pod,
                   and the proxy runs on the head only (proxy_location HeadOnly) */}}
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
  {{- else }}
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
  {{- end }}
{{- end -}}

{{/* "true" in the RayService form: `replicas` set (a count or {min, max, ...}); "false" in the RayCluster form. */}}
{{- define "specdist.rayService" -}}
{{- not (kindIs "invalid" .Values.replicas) -}}
{{- end -}}

{{/* The most replicas (and replica pods): the count, or replicas.max (replicas.min without one). */}}
{{- define "specdist.replicasMax" -}}
{{- $r := .Values.replicas -}}
{{- if kindIs "map" $r }}{{ (hasKey $r "max" | ternary $r.max $r.min) | int }}{{ else }}{{ $r | int }}{{ end -}}
{{- end -}}

{{/* The custom Ray resource only the head offers, which the front doors ask for (build_app's front_resource). */}}
{{- define "specdist.frontResource" -}}specdist_front{{- end -}}

{{/* The file the RayService head's command writes once every replica pod has joined (its readiness). */}}
{{- define "specdist.joinedMarker" -}}/tmp/specdist-replica-pods-joined{{- end -}}

{{/* Ray CPUs of one replica pod: one replica's placement group (cluster/placement.py replica_bundles: the
     replica's own bundle COORDINATOR_BUNDLE, 0.1 CPU, then the ranks and the drafts), rounded up (Ray counts
     whole CPUs a node). */}}
{{- define "specdist.replicaCpus" -}}
{{- $ranks := mulf .Values.target.tensorParallelSize .Values.target.cpusPerRank -}}
{{- $drafts := mulf .Values.draft.replicas .Values.draft.cpusPerReplica -}}
{{- addf 0.1 $ranks $drafts | ceil | int -}}
{{- end -}}

{{/* GPUs of one replica pod: one a target rank (target.gpusPerPod) plus the drafts'. */}}
{{- define "specdist.replicaGpus" -}}
{{- add (int .Values.target.gpusPerPod) (mul (int .Values.draft.replicas) (int .Values.draft.gpusPerReplica)) -}}
{{- end -}}

{{/* Ray Serve's config of the RayService form (serveConfigV2; ray.serve.schema.ServeDeploySchema): one
     application, the builder cluster.serve:build_app, whose args are specdist's config (the ConfigMap's
     config.yaml, from the same named template) and the front doors' flags as `specdist serve` takes them. No
     `deployments` overrides: build_app derives the replicas' Serve options (num_replicas, or autoscaling_config
     from replicas.min / max / ...) from the config's cluster.replicas, so the two cannot disagree. Serve's own
     HTTP proxy runs on the head only, on 8000, where KubeRay checks its health (/-/healthz) to label the head
     for the Service; the application is not exposed through it (route_prefix null): clients reach the front's
     own gRPC / HTTP ports. */}}
{{- define "specdist.serveConfig" -}}
{{- $tls := include "specdist.tlsDir" . -}}
{{- $auth := include "specdist.authDir" . -}}
proxy_location: HeadOnly
http_options:
  host: 0.0.0.0
  port: {{ include "specdist.serveProxyPort" . }}
applications:
  - name: specdist
    import_path: cluster.serve:build_app
    route_prefix: null
    args:
      grpc_port: {{ .Values.serve.port | int }}
      {{- if .Values.serve.http.enabled }}
      http_port: {{ .Values.serve.http.port | int }}
      {{- end }}
      {{- if .Values.metrics.enabled }}
      metrics_port: {{ .Values.metrics.port | int }}
      {{- end }}
      host: 0.0.0.0
      max_queued: {{ .Values.serve.maxQueued | default 256 | int }}
      drain_seconds: {{ .Values.serve.drainSeconds | int }}
      worker_host: {{ .Values.serve.workerHost | quote }}
      front_resource: {{ include "specdist.frontResource" . }}
      {{- with .Values.serve.tls }}{{ if .secretName }}
      tls_cert: {{ $tls }}/tls.crt
      tls_key: {{ $tls }}/tls.key
      {{- if .clientCA }}
      tls_client_ca: {{ $tls }}/ca.crt
      {{- end }}
      {{- end }}{{ end }}
      {{- with .Values.serve.auth }}{{ if .tokenSecretName }}
      auth_token_file: {{ $auth }}/{{ .tokenKey }}
      {{- if .adminTokenKey }}
      admin_token_file: {{ $auth }}/{{ .adminTokenKey }}
      {{- end }}
      {{- end }}{{ end }}
      config:
        {{- include "specdist.config" . | nindent 8 }}
{{- end -}}

{{/* Ray Serve's HTTP proxy port on the head (Serve's and KubeRay's default, 8000: KubeRay checks it there). */}}
{{- define "specdist.serveProxyPort" -}}8000{{- end -}}

{{/* Checks of the RayService form (each fails with the value's key first). */}}
{{- define "specdist.validateRayService" -}}
{{- $r := .Values.replicas -}}
{{- if and (kindIs "map" $r) (hasKey $r "max") (lt (int $r.max) (int $r.min)) -}}
{{- fail (printf "replicas.max: must be >= replicas.min (%d), got %d" (int $r.min) (int $r.max)) -}}
{{- end -}}
{{- if .Values.bench.enabled -}}
{{- fail "bench.enabled: the bench RayJob runs on the RayCluster form's cluster; with replicas (the RayService form) run `specdist bench cluster --server <Service>` yourself" -}}
{{- end -}}
{{- $proxy := int (include "specdist.serveProxyPort" .) -}}
{{- range $p := list (list true "serve.port" .Values.serve.port) (list .Values.serve.http.enabled "serve.http.port" .Values.serve.http.port) (list .Values.metrics.enabled "metrics.port" .Values.metrics.port) -}}
{{- if and (index $p 0) (eq (int (index $p 2)) $proxy) -}}
{{- fail (printf "%s: port %d is Ray Serve's HTTP proxy on the head in the RayService form (replicas set; KubeRay checks its health there): pick another" (index $p 1) $proxy) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The ports of the public Service (service.yaml; the RayService's serveService), by the head container's port
     names. */}}
{{- define "specdist.servicePorts" -}}
- name: grpc
  port: {{ .Values.serve.port | int }}
  targetPort: grpc
  protocol: TCP
  {{- if not .Values.serve.tls.secretName }}
  appProtocol: kubernetes.io/h2c
  {{- end }}
{{- if .Values.serve.http.enabled }}
- name: http
  port: {{ .Values.serve.http.port | int }}
  targetPort: http
  protocol: TCP
{{- end }}
{{- if .Values.metrics.enabled }}
- name: http-metrics
  port: {{ .Values.metrics.port | int }}
  targetPort: http-metrics
  protocol: TCP
{{- end }}
{{- end -}}
