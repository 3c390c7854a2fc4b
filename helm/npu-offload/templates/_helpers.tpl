{{- define "npu-offload.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "npu-offload.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "npu-offload.labels" -}}
{{ include "npu-offload.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The model name clients send: servedName, else the checkpoint directory's name (as the worker does). */}}
{{- define "npu-offload.modelName" -}}
{{- if .Values.model.servedName -}}{{ .Values.model.servedName }}
{{- else if .Values.model.path -}}{{ base .Values.model.path }}
{{- else if eq .Values.backend "mock" -}}mock
{{- else -}}moe-offload-demo
{{- end -}}
{{- end -}}

{{/* A label value holds at most 63 of [A-Za-z0-9._-] and starts/ends alphanumeric: "org/Model" -> "org-Model". */}}
{{- define "npu-offload.modelLabel" -}}
{{- regexReplaceAll "[^A-Za-z0-9._-]" (include "npu-offload.modelName" .) "-" | trunc 63 | trimAll "-._" -}}
{{- end -}}

{{/* Labels llm-d's endpoint picker and the InferencePool select on. */}}
{{- define "npu-offload.llmdLabels" -}}
llm-d.ai/inferenceServing: "true"
llm-d.ai/model: {{ include "npu-offload.modelLabel" . | quote }}
llm-d.ai/role: decode
{{- end -}}

{{/* The extended resource of the backend's accelerator; empty for cpu and mock. */}}
{{- define "npu-offload.acceleratorResource" -}}
{{- $known := list "mock" "cpu" "cuda" "rngd" -}}
{{- if not (has .Values.backend $known) -}}
{{- fail (printf "backend=%q: expected one of mock, cpu, cuda, rngd" .Values.backend) -}}
{{- end -}}
{{- if eq .Values.backend "cuda" -}}nvidia.com/gpu
{{- else if eq .Values.backend "rngd" -}}furiosa.ai/rngd
{{- end -}}
{{- end -}}
