{{/* Names and labels shared by every template. */}}

{{- define "logprobd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's resource name; also the `service` label Prometheus gives the scraped series. */}}
{{- define "logprobd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "logprobd.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "logprobd.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "logprobd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "logprobd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "logprobd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "logprobd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/component: scoring
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "logprobd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "logprobd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "logprobd.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* PromQL label matchers of this release's series, as a ServiceMonitor scrape labels them. */}}
{{- define "logprobd.promSelector" -}}
namespace="{{ .Release.Namespace }}", service="{{ include "logprobd.fullname" . }}"
{{- end }}

{{/*
The pod's grace period: the preStop sleep, then the service's drain (LOGPROBD_DRAIN_SECONDS), then
up to 30 s of uvicorn graceful shutdown for requests still in flight (service/http/server.py,
GRACEFUL_SHUTDOWN_S), plus a margin. An explicit value wins.
*/}}
{{- define "logprobd.terminationGracePeriodSeconds" -}}
{{- .Values.drain.terminationGracePeriodSeconds | default (add .Values.drain.preStopSleepSeconds .Values.drain.seconds 30 10) }}
{{- end }}

{{/* The model volume's claim: the chart's own PVC or an existing one. */}}
{{- define "logprobd.modelClaimName" -}}
{{- if eq .Values.model.volume.type "pvc" }}
{{- printf "%s-models" (include "logprobd.fullname" .) }}
{{- else }}
{{- required "model.volume.existingClaim is required when model.volume.type is existingClaim" .Values.model.volume.existingClaim }}
{{- end }}
{{- end }}

{{/* Checks across values that values.schema.json cannot express. */}}
{{- define "logprobd.validate" -}}
{{- if lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas) }}
{{- fail "autoscaling.maxReplicas must be at least autoscaling.minReplicas" }}
{{- end }}
{{- if and (gt (int .Values.gpu.perPod) 1) (ne .Values.gpu.resourceKey "nvidia.com/gpu") }}
{{- fail "gpu.perPod > 1 (tensor parallel) needs whole GPUs: gpu.resourceKey nvidia.com/gpu, not a MIG slice" }}
{{- end }}
{{- end }}

{{/* /dev/shm for tensor-parallel ranks: (list sizeLimitPerGpu gpus) -> e.g. 4Gi x 2 = 8Gi */}}
{{- define "logprobd.shmPerGpu" -}}
{{- $per := index . 0 | toString }}
{{- $gpus := index . 1 | int }}
{{- $number := regexFind "^[0-9]+" $per | int }}
{{- $unit := regexReplaceAll "^[0-9]+" $per "" }}
{{- printf "%d%s" (mul $number $gpus) $unit }}
{{- end }}
