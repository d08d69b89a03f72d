{{/* Resource name prefix: the release name, plus the chart name unless it is in it. */}}
{{- define "ramify.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 44 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 44 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 44 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{/* 44 leaves room for the longest suffix ("-node-agent-metrics", 19) within the 63
     characters of a Service name. */}}

{{- define "ramify.operator.name" -}}{{ include "ramify.fullname" . }}-operator{{- end -}}
{{- define "ramify.agent.name" -}}{{ include "ramify.fullname" . }}-node-agent{{- end -}}
{{- define "ramify.api.name" -}}{{ include "ramify.fullname" . }}-api{{- end -}}

{{- define "ramify.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ramify
{{- end -}}

{{/* Selector labels of one component; pass (dict "ctx" $ "component" "operator"). */}}
{{- define "ramify.selectorLabels" -}}
app.kubernetes.io/name: {{ default .ctx.Chart.Name .ctx.Values.nameOverride }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ramify.componentLabels" -}}
{{ include "ramify.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- /* repository@digest when a digest is set, else repository:tag (default: appVersion). */}}
{{- define "ramify.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}
