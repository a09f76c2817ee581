{{/* Chart name, or nameOverride. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Prefix of every object name: fullnameOverride, else "<release>-<name>" (just the release name when
it already contains the chart name). 40 characters at most: KubeRay derives pod and service names
from the RayCluster name and Kubernetes caps those at 63.
*/}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "tandem.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels that pick this release's objects. */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The pools this mode runs, as a JSON list. */}}
{{- define "tandem.roles" -}}
{{- if eq .Values.mode "colocated" -}}
["colocated"]
{{- else if eq .Values.mode "disaggregated" -}}
["prefill", "decode"]
{{- else -}}
{{- fail (printf "mode must be disaggregated or colocated, not %q" .Values.mode) -}}
{{- end -}}
{{- end -}}

{{/* The Ray custom resource that ties a pool's workers to its worker group. */}}
{{- define "tandem.poolResource" -}}
{{- printf "tandem_%s" . -}}
{{- end -}}

{{/* The tandem pool config (cluster/control/config.py), from values. */}}
{{- define "tandem.poolConfig" -}}
{{- $config := deepCopy .Values.config -}}
{{- $ingress := default (dict) $config.ingress -}}
{{- if or (hasKey $ingress "api_keys") (hasKey $ingress "admin_key") -}}
{{- fail "keep API and admin keys out of config.ingress (it is rendered into a ConfigMap): use access.apiKeys, access.adminKey or access.existingSecret" -}}
{{- end -}}
{{- $_ := set $ingress "admin_key_file" (printf "%s/admin-key" (include "tandem.keysDir" .)) -}}
{{- if .Values.access.allowAnonymous -}}
{{- $_ := set $ingress "allow_anonymous" true -}}
{{- else -}}
{{- $_ := set $ingress "api_keys_file" (printf "%s/api_keys.yaml" (include "tandem.keysDir" .)) -}}
{{- end -}}
{{- $_ := set $config "ingress" $ingress -}}
{{- $_ := set $config "mode" .Values.mode -}}
{{- $_ := set $config "model" (dict "path" .Values.model.path "dtype" .Values.model.dtype "max_model_len" .Values.model.maxModelLen) -}}
{{- range $role := include "tandem.roles" . | fromJsonArray -}}
{{- $pool := index $.Values.pools $role -}}
{{- $resources := dict (include "tandem.poolResource" $role) 1 -}}
{{- $_ := set $config $role (dict "replicas" $pool.replicas "num_cpus" $pool.cpusPerWorker "num_gpus" $pool.gpusPerWorker "resources" $resources) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Volumes every Ray pod mounts: shared memory for the object store, and the checkpoint. */}}
{{- define "tandem.volumes" -}}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shmSize }}
{{- with .Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "tandem.volumeMounts" -}}
- name: shm
  mountPath: /dev/shm
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Where the head pod mounts the keys Secret (not under the ConfigMap mount: that one is read-only). */}}
{{- define "tandem.keysDir" -}}/etc/tandem-keys{{- end -}}

{{/* The Secret holding api_keys.yaml and admin-key: the user's, or the chart's own. */}}
{{- define "tandem.keysSecret" -}}
{{- default (printf "%s-keys" (include "tandem.fullname" .)) .Values.access.existingSecret -}}
{{- end -}}
