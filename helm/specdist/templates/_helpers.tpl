{{/* Names. KubeRay wants the RayCluster name DNS-1035 (a letter first) and short enough for the
     names it derives from it; the bench RayJob adds "-bench-<run>" (RayJob names: 47 characters). */}}
{{- define "specdist.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 32 | trimSuffix "-" -}}
{{- end -}}

{{- define "specdist.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 32 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 32 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 32 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of the chart's own objects. Pod templates get only specdist.podLabels: KubeRay's head
     Service selects app.kubernetes.io/name=kuberay, so a pod label overriding it would cut the
     workers off from the head. */}}
{{- define "specdist.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "specdist.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The Service's labels a ServiceMonitor selects on (stable across chart versions). */}}
{{- define "specdist.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdist.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specdist.podLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: specdist
{{- end -}}

{{- define "specdist.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* Where the rendered specdist config and the helper script live in the head pod. */}}
{{- define "specdist.configDir" -}}/etc/specdist{{- end -}}

{{- define "specdist.useGpu" -}}
{{- if gt (int .Values.target.gpusPerPod) 0 }}true{{ else }}false{{ end -}}
{{- end -}}

{{/* A number as a YAML float PyYAML reads as one: Go writes 0.00001 as 1e-05, which YAML 1.1 (no dot)
     reads as a string; 1.0e-05 it reads as a float. */}}
{{- define "specdist.yamlFloat" -}}
{{- regexReplaceAll "^(-?[0-9]+)e" (toString (float64 .)) "${1}.0e" -}}
{{- end -}}

{{/* Worker pods the head waits for before bring-up: the target pod and one pod per draft. */}}
{{- define "specdist.expectedWorkers" -}}
{{- add 1 (int .Values.draft.replicas) -}}
{{- end -}}

{{/* terminationGracePeriodSeconds of the head: the drain, then the deployment's tear-down. */}}
{{- define "specdist.gracePeriod" -}}
{{- add (int .Values.serve.drainSeconds) (int .Values.serve.teardownSeconds) -}}
{{- end -}}

{{/* Checks the values schema cannot express (or not with a message saying why); each fails with the
     value's key first. */}}
{{- define "specdist.validate" -}}
{{- $full := include "specdist.fullname" . -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $full) -}}
{{- fail (printf "fullnameOverride / release name: %q is not a DNS-1035 label (KubeRay names the RayCluster after it; start with a letter)" $full) -}}
{{- end -}}
{{- $ports := dict (toString (int .Values.serve.port)) "serve.port" -}}
{{- range $p := list (list .Values.serve.http.enabled "serve.http.port" .Values.serve.http.port) (list .Values.metrics.enabled "metrics.port" .Values.metrics.port) -}}
{{- if index $p 0 -}}
{{- $port := toString (int (index $p 2)) -}}
{{- if hasKey $ports $port -}}
{{- fail (printf "%s: port %s is already %s's" (index $p 1) $port (get $ports $port)) -}}
{{- end -}}
{{- $_ := set $ports $port (index $p 1) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) -}}
{{- fail "metrics.serviceMonitor.enabled: needs metrics.enabled (the port it scrapes)" -}}
{{- end -}}
{{- if and .Values.bench.enabled (or .Values.serve.tls.secretName .Values.serve.auth.tokenSecretName) -}}
{{- fail "bench.enabled: `specdist bench cluster` has no TLS or token flags; the bench job cannot reach a server with serve.tls or serve.auth" -}}
{{- end -}}
{{- if and .Values.serve.auth.adminTokenKey (not .Values.serve.auth.tokenSecretName) -}}
{{- fail "serve.auth.adminTokenKey: needs serve.auth.tokenSecretName (the Secret holding it)" -}}
{{- end -}}
{{- if and .Values.serve.auth.adminTokenKey (eq .Values.serve.auth.adminTokenKey .Values.serve.auth.tokenKey) -}}
{{- fail "serve.auth.adminTokenKey: must differ from serve.auth.tokenKey (the admin token is no tenant's)" -}}
{{- end -}}
{{- if and .Values.serve.tls.clientCA (not .Values.serve.tls.secretName) -}}
{{- fail "serve.tls.clientCA: needs serve.tls.secretName (client certificates need TLS)" -}}
{{- end -}}
{{- if and (has (toString .Values.engine.compile) (list "on" "true")) (gt (int .Values.target.tensorParallelSize) 1) -}}
{{- fail (printf "engine.compile: compiled passes run on one rank; with target.tensorParallelSize %d use auto or off" (int .Values.target.tensorParallelSize)) -}}
{{- end -}}
{{- with .Values.engine.compileCacheDir -}}
{{- $dir := trimSuffix "/" (toString .) -}}
{{- $cache := $.Values.security.cacheDir -}}
{{- if not (or (hasPrefix "/tmp/" $dir) (eq $dir "/tmp") (eq $dir $cache) (hasPrefix (printf "%s/" $cache) $dir)) -}}
{{- fail (printf "engine.compileCacheDir: %s is on the read-only root filesystem; use a path under /tmp or security.cacheDir (%s)" $dir $cache) -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.ray.auth.mode "disabled") .Values.ray.auth.secretName -}}
{{- fail "ray.auth.secretName: only used with ray.auth.mode token" -}}
{{- end -}}
{{- /* draft.settings may not name a key the chart renders from a named value: the config would hold it twice and
     the last would win (suffix_scope: shared undoing tenant isolation). The schema refuses them too; this holds
     under --skip-schema-validation. */ -}}
{{- range $key, $_ := .Values.draft.settings -}}
{{- if has $key (include "specdist.reservedDraftKeys" $ | splitList " ") -}}
{{- fail (printf "draft.settings.%s: the chart renders this key from its own value (draft.* or model.draft); set that instead" $key) -}}
{{- end -}}
{{- if not (regexMatch "^[a-z][a-z0-9_]*$" $key) -}}
{{- fail (printf "draft.settings: %q is not a setting's name (lowercase letters, digits and _)" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The draft keys the ConfigMap renders from named values (and "settings"): draft.settings may not use them.
     values.schema.json's draft.settings.propertyNames lists the same (tests/deploy/test_helm_chart.py). */}}
{{- define "specdist.reservedDraftKeys" -}}
method model dtype num_speculative_tokens length_policy confidence_threshold ngram_min ngram_max suffix_max_depth suffix_min_prob suffix_max_spec_factor suffix_cache_requests suffix_cache_tokens suffix_scope suffix_min_score pipeline pipeline_miss q_top_k settings
{{- end -}}

{{/* Environment of every Ray container: no hub downloads; Ray auth when it is off. */}}
{{- define "specdist.env" -}}
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
{{- if eq .Values.ray.auth.mode "disabled" }}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- with .Values.security.cacheDir }}
- name: XDG_CACHE_HOME
  value: {{ . }}
- name: TRITON_CACHE_DIR
  value: {{ . }}/triton
{{- if not $.Values.engine.compileCacheDir }}
- name: TORCHINDUCTOR_CACHE_DIR
  value: {{ . }}/specdist/inductor
{{- end }}
{{- end }}
{{- end -}}

{{/* Pod-level security of every pod: a fixed non-root uid / gid; fsGroup, the group the Secret files (mode 0440)
     belong to and the containers are members of; the runtime's default seccomp profile; OnRootMismatch, so that a
     model volume already owned by fsGroup is not walked at every start. No service account token: nothing in
     the pods calls the Kubernetes API (the in-tree autoscaler is off). */}}
{{- define "specdist.podSecurity" -}}
automountServiceAccountToken: false
securityContext:
  runAsNonRoot: true
  runAsUser: {{ .Values.security.runAsUser | int64 }}
  runAsGroup: {{ .Values.security.runAsGroup | int64 }}
  fsGroup: {{ .Values.security.fsGroup | int64 }}
  fsGroupChangePolicy: OnRootMismatch
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{/* Container-level security of every container. KubeRay copies it (and the volume mounts) into the
     wait-gcs-ready init container it adds to worker pods. */}}
{{- define "specdist.containerSecurity" -}}
securityContext:
  runAsNonRoot: true
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop:
      - ALL
{{- end -}}

{{/* The writable directories under the read-only root filesystem: /tmp (Ray's session directory /tmp/ray: logs,
     sockets, spilled objects; temporary files of the C compiler and of Python) and security.cacheDir (the
     caches of specdist.env). KubeRay mounts /dev/shm (Ray's object store) itself. */}}
{{- define "specdist.writableVolumes" -}}
- name: specdist-tmp
  emptyDir: {}
- name: specdist-cache
  emptyDir: {}
{{- end -}}

{{- define "specdist.writableMounts" -}}
- name: specdist-tmp
  mountPath: /tmp
- name: specdist-cache
  mountPath: {{ .Values.security.cacheDir }}
{{- end -}}

{{/* Probes of the target and draft containers, which run `ray start --block` (a Ray worker node) and host the
     specdist worker actors. A raylet that dies ends `ray start`, and the container with it; the liveness probe
     catches a raylet that hangs. Both ask the dashboard agent's /api/local_raylet_healthz (Ray's agent port
     52365, public under Ray token auth): 200 while the GCS reports this node alive, also while the GCS cannot
     be reached (the head restarting), so the workers are not restarted while the head comes back. A kubelet HTTP
     probe, not KubeRay's injected one: KubeRay injects its own only when a container has none and its
     ENABLE_PROBES_INJECTION is on, as exec wget for Ray < 2.53; an httpGet probe starts no process.
     Liveness allows 10 minutes of failures (KubeRay's default window): restarting the target pod tears down
     every rank (a target group rebuild), so a raylet slowed down by model loading must not be killed.
     Readiness: the node has joined the cluster (the RayCluster counts Ready workers; the bench RayJob waits for
     them). The worker actors' own gRPC health is not probed here: their ports are free ports picked at bring-up,
     which the pod spec cannot name; the head's supervisor (cluster/supervisor.py) checks them. */}}
{{- define "specdist.workerProbes" -}}
livenessProbe:
  httpGet:
    path: /api/local_raylet_healthz
    port: 52365
  initialDelaySeconds: 30
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 60
readinessProbe:
  httpGet:
    path: /api/local_raylet_healthz
    port: 52365
  initialDelaySeconds: 10
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 3
{{- end -}}

{{- define "specdist.modelVolume" -}}
{{- $v := .Values.model.volume -}}
{{- if $v.claimName }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $v.claimName }}
    readOnly: true
{{- else if $v.hostPath }}
- name: models
  hostPath:
    path: {{ $v.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "specdist.modelVolumeMount" -}}
{{- $v := .Values.model.volume -}}
{{- if or $v.claimName $v.hostPath }}
- name: models
  mountPath: {{ $v.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* nodeSelector / tolerations / affinity / imagePullSecrets of one pod template (dict "v" <group values> "root" $). */}}
{{- define "specdist.scheduling" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.nodeSelector }}
nodeSelector:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.tolerations }}
tolerations:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.affinity }}
affinity:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Container resources of a worker group plus its GPUs (dict "v" <group values> "gpus" N "root" $). */}}
{{- define "specdist.resources" -}}
{{- $res := deepCopy (default dict .v.resources) -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := deepCopy (default dict $res.limits) -}}
{{- $_ := set $limits .root.Values.gpuResource (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- if $res.requests -}}
{{- $requests := deepCopy $res.requests -}}
{{- $_ := set $requests .root.Values.gpuResource (int .gpus) -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Where the TLS Secret and the token Secret are mounted in the head (read-only). */}}
{{- define "specdist.tlsDir" -}}/var/run/secrets/specdist/tls{{- end -}}
{{- define "specdist.authDir" -}}/var/run/secrets/specdist/auth{{- end -}}

{{/* The flags of `specdist serve` beyond the gRPC port: HTTP API, metrics, TLS, token (one line). */}}
{{- define "specdist.serveExtraArgs" -}}
{{- $tls := include "specdist.tlsDir" . -}}
{{- with .Values.serve.http }}{{ if .enabled }} --http-port {{ .port | int }}{{ end }}{{ end -}}
{{- with .Values.metrics }}{{ if .enabled }} --metrics-port {{ .port | int }}{{ end }}{{ end -}}
{{- with .Values.serve.tls }}{{ if .secretName }} --tls-cert {{ $tls }}/tls.crt --tls-key {{ $tls }}/tls.key{{ if .clientCA }} --tls-client-ca {{ $tls }}/ca.crt{{ end }}{{ end }}{{ end -}}
{{- with .Values.serve.auth }}{{ if .tokenSecretName }} --auth-token-file {{ include "specdist.authDir" $ }}/{{ .tokenKey }}{{ if .adminTokenKey }} --admin-token-file {{ include "specdist.authDir" $ }}/{{ .adminTokenKey }}{{ end }}{{ end }}{{ end -}}
{{- end -}}

{{/* The head's Secret volumes (TLS, token) and their read-only mounts. The files belong to root and to fsGroup
     (security.fsGroup), mode 0440: the containers' non-root user reads them as a member of that group. */}}
{{- define "specdist.secretVolumes" -}}
{{- with .Values.serve.tls.secretName }}
- name: specdist-tls
  secret:
    secretName: {{ . }}
    defaultMode: 288 # 0440: owner and group (fsGroup) read, nobody writes
{{- end }}
{{- with .Values.serve.auth }}{{ if .tokenSecretName }}
- name: specdist-auth
  secret:
    secretName: {{ .tokenSecretName }}
    defaultMode: 288 # 0440
    items:
      - key: {{ .tokenKey }}
        path: {{ .tokenKey }}
      {{- with .adminTokenKey }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}{{ end }}
{{- end -}}

{{- define "specdist.secretVolumeMounts" -}}
{{- if .Values.serve.tls.secretName }}
- name: specdist-tls
  mountPath: {{ include "specdist.tlsDir" . }}
  readOnly: true
{{- end }}
{{- if .Values.serve.auth.tokenSecretName }}
- name: specdist-auth
  mountPath: {{ include "specdist.authDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* One probe of the head and its timeout (dict "root" $ "service" <grpc health service or ""> "timeout" <s>).
     The script gets 2 s less, for the Python start, so it fails with its own message. Plaintext: the kubelet's
     gRPC probe. With TLS the kubelet's gRPC probe cannot connect (it speaks plaintext only), so an exec
     probe runs files/grpc_health_probe.py over TLS in the container instead. Health needs no token. */}}
{{- define "specdist.probe" -}}
{{- $v := .root.Values -}}
{{- if $v.serve.tls.secretName -}}
exec:
  command:
    - python
    - {{ include "specdist.configDir" .root }}/grpc_health_probe.py
    - --port
    - {{ $v.serve.port | int | quote }}
    - --tls-dir
    - {{ include "specdist.tlsDir" .root }}
    {{- if $v.serve.tls.clientCA }}
    - --client-cert
    {{- end }}
    {{- with .service }}
    - --service
    - {{ . }}
    {{- end }}
    - --timeout
    - {{ sub .timeout 2 | quote }}
{{- else -}}
grpc:
  port: {{ $v.serve.port | int }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
timeoutSeconds: {{ .timeout }}
{{- end -}}
