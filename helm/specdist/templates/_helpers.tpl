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

{{/* Worker pods the head waits for before bring-up: the target pod and one pod per draft. */}}
{{- define "specdist.expectedWorkers" -}}
{{- add 1 (int .Values.draft.replicas) -}}
{{- end -}}

{{/* terminationGracePeriodSeconds of the head: the drain, then the deployment's tear-down. */}}
{{- define "specdist.gracePeriod" -}}
{{- add (int .Values.serve.drainSeconds) (int .Values.serve.teardownSeconds) -}}
{{- end -}}

{{/* Checks the values schema cannot express; each fails with the value's key first. */}}
{{- define "specdist.validate" -}}
{{- $full := include "specdist.fullname" . -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $full) -}}
{{- fail (printf "fullnameOverride / release name: %q is not a DNS-1035 label (KubeRay names the RayCluster after it; start with a letter)" $full) -}}
{{- end -}}
{{- if .Values.serve.auth.tokenSecret -}}
{{- fail "serve.auth.tokenSecret: `specdist serve` has no token auth on its public port yet; leave it empty and restrict the Service (NetworkPolicy) instead" -}}
{{- end -}}
{{- if .Values.serve.tls.secretName -}}
{{- fail "serve.tls.secretName: `specdist serve` has no TLS on its public port yet; leave it empty and terminate TLS in front of the Service" -}}
{{- end -}}
{{- if and (eq .Values.ray.auth.mode "disabled") .Values.ray.auth.secretName -}}
{{- fail "ray.auth.secretName: only used with ray.auth.mode token" -}}
{{- end -}}
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
