{{/* Names: every object is <release>-<component> (or <fullname>-<component>), unless the release is named kvferry. */}}
{{- define "kvferry.fullname" -}}
{{- if contains "kvferry" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-kvferry" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvferry.name" -}}
{{- printf "%s-%s" (include "kvferry.fullname" .root) .component -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "kvferry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: kvferry
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
{{ include "kvferry.selectorLabels" . }}
{{- end -}}

{{/* Labels that select a component's pods. */}}
{{- define "kvferry.selectorLabels" -}}
app.kubernetes.io/name: kvferry
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* An image reference from {repository, tag, digest}; .default is the tag when none is given. */}}
{{- define "kvferry.imageRef" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .default) -}}
{{- end -}}
{{- end -}}

{{- define "kvferry.image" -}}
{{- include "kvferry.imageRef" (dict "image" .Values.image "default" .Chart.AppVersion) -}}
{{- end -}}

{{/* The securityContext of every container the chart writes (Pod Security "restricted"). */}}
{{- define "kvferry.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "kvferry.registryAddress" -}}
{{- printf "%s:%v" (include "kvferry.name" (dict "root" . "component" "registry")) .Values.registry.port -}}
{{- end -}}

{{- define "kvferry.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "%s:2379" (include "kvferry.name" (dict "root" . "component" "etcd-client")) -}}
{{- else -}}
{{- required "etcd.external.endpoints: give the etcd client endpoints (host:port) when etcd.enabled is false" (.Values.etcd.external.endpoints | join ",") -}}
{{- end -}}
{{- end -}}

{{/*
TLS. tls.mode picks where each component's certificate comes from; "kvferry.tls.secret" names the Secret
(empty: no TLS, or a per-pod csi volume for engines). Every kvferry container mounts it at /etc/kvferry/tls
(tls.crt, tls.key, ca.crt).
*/}}
{{- define "kvferry.tls.enabled" -}}
{{- if ne .Values.tls.mode "none" -}}true{{- end -}}
{{- end -}}

{{- define "kvferry.tls.secret" -}}
{{- $root := .root -}}
{{- if eq $root.Values.tls.mode "certManager" -}}
{{- printf "%s-tls" (include "kvferry.name" (dict "root" $root "component" .component)) -}}
{{- else if eq $root.Values.tls.mode "secrets" -}}
{{- required (printf "tls.secrets.%s: name the Secret (tls.crt, tls.key, ca.crt) when tls.mode is secrets" .component) (get $root.Values.tls.secrets .component) -}}
{{- end -}}
{{- end -}}

{{- define "kvferry.tls.volume" -}}
{{- if include "kvferry.tls.enabled" .root }}
- name: kvferry-tls
  secret:
    secretName: {{ include "kvferry.tls.secret" . }}
{{- end }}
{{- end -}}

{{- define "kvferry.tls.mount" -}}
{{- if include "kvferry.tls.enabled" . }}
- name: kvferry-tls
  mountPath: /etc/kvferry/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The TLS flags of a kvferry process (registry, router, sidecar): its certificate at /etc/kvferry/tls. The
registry serves mutual TLS and checks each caller's role; the router serves agents over TLS and calls the
registry as `router`; a sidecar calls it as `engine:<pod name>` (docs/security.md). Engines under TLS need
one certificate per pod (the registry lets an engine speak only for the engine id its certificate names).
*/}}
{{- define "kvferry.tls.args" -}}
{{- $root := .root -}}
{{- if include "kvferry.tls.enabled" $root }}
{{- if and (eq .component "engine") (ne $root.Values.tls.certManager.engineCertificates "perPod") }}
{{- fail "engines under TLS need a certificate each (the registry lets an engine act only for the engine id its certificate names): set tls.certManager.engineCertificates perPod (cert-manager's csi-driver, tls.certManager.issuerRef)" }}
{{- end }}
- --tls-cert=/etc/kvferry/tls/tls.crt
- --tls-key=/etc/kvferry/tls/tls.key
- --tls-ca=/etc/kvferry/tls/ca.crt
{{- end }}
{{- end -}}

{{/*
kvferry-health's TLS flags for a probe of the component's own port (as JSON list items, each with a leading
comma): the CA, the component's certificate (the registry asks for one) and the name its certificate holds.
*/}}
{{- define "kvferry.tls.probeArgs" -}}
{{- if include "kvferry.tls.enabled" .root -}}
, "--tls-ca=/etc/kvferry/tls/ca.crt", "--tls-cert=/etc/kvferry/tls/tls.crt", "--tls-key=/etc/kvferry/tls/tls.key", "--server-name={{ include "kvferry.name" . }}"
{{- end -}}
{{- end -}}
