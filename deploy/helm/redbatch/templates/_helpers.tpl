{{/* The prefix of every object's name: the release name, with "-redbatch" unless it says so. */}}
{{- define "redbatch.fullname" -}}
{{- if contains "redbatch" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-redbatch" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "redbatch.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Selector labels of one component: redbatch.selectorLabels (list . "worker") */}}
{{- define "redbatch.selectorLabels" -}}
app.kubernetes.io/name: redbatch
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "redbatch.labels" -}}
{{ include "redbatch.selectorLabels" . }}
app.kubernetes.io/version: {{ (index . 0).Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ (index . 0).Release.Service }}
helm.sh/chart: {{ printf "%s-%s" (index . 0).Chart.Name (index . 0).Chart.Version }}
{{- end -}}

{{/* The worker's model name in its stream key: as worker/settings.py derives model_name. */}}
{{- define "redbatch.modelName" -}}
{{- .Values.worker.model | splitList ":" | last | lower -}}
{{- end -}}

{{/* The Redis Secret's name, and (when the chart creates it) its required values. */}}
{{- define "redbatch.redisSecret" -}}
{{- required "redis.secret.name is required: the Secret with the keys address and password" .Values.redis.secret.name -}}
{{- end -}}

{{/* Redis: address and password from the Secret; the password apart from the URL. */}}
{{- define "redbatch.redisEnv" -}}
- name: REDIS_ADDRESS
  valueFrom: {secretKeyRef: {name: {{ include "redbatch.redisSecret" . }}, key: address}}
- name: REDIS_PASSWORD  # KEDA reads it by this name (passwordFromEnv)
  valueFrom: {secretKeyRef: {name: {{ include "redbatch.redisSecret" . }}, key: password}}
- name: REDBATCH_REDIS_PASSWORD  # as it is: no URL encoding, out of the URL
  value: $(REDIS_PASSWORD)
- name: REDBATCH_REDIS_URL
  value: redis://$(REDIS_ADDRESS)/{{ .Values.redis.database | int }}
{{- end -}}
