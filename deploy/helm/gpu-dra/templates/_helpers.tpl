{{/*
The namespace of the plugin's namespaced objects: values' namespace.name, not the release's namespace,
so that the defaults render what `kubectl kustomize deploy/overlays/nvml` renders whatever `-n` says.
*/}}
{{- define "gpu-dra.namespace" -}}
{{- .Values.namespace.name -}}
{{- end }}

{{/*
The backend's environment variables. Where they stand in the container's env follows the kustomize
variants (the fake overlay's strategic merge patch puts its entries first), so that tests/manifests can
compare the chart's objects with kustomize's exactly.
*/}}
{{- define "gpu-dra.backendEnv" -}}
- name: GPU_BACKEND
  value: {{ .Values.backend | quote }}
- name: MIG_MODE
  value: {{ .Values.migMode | quote }}
{{- if eq .Values.backend "fake" }}
- name: FAKE_GPU_PROFILE
  value: /etc/gpu-dra/profile.yaml
# On the host, so that fake MIG devices outlive plugin restarts as real ones do.
- name: FAKE_GPU_STATE
  value: /var/lib/gpu-dra/fake-state.json
{{- else }}
# The NVIDIA driver's root on the host, which claim CDI specs name; the GPU Operator's driver
# container: /run/nvidia/driver. The driver-root volume mounts the same directory.
- name: NVIDIA_DRIVER_ROOT
  value: {{ .Values.driverRoot | quote }}
# Where this container sees it.
- name: CONTAINER_DRIVER_ROOT
  value: /driver-root
{{- end }}
{{- end }}

{{/*
The plugin's driver name: NVIDIA's with nvidiaCompatibility.enabled (deploy/components/nvidia-compat).
*/}}
{{- define "gpu-dra.driverName" -}}
{{- if .Values.nvidiaCompatibility.enabled -}}gpu.nvidia.com{{- else -}}gpu.dra.dev{{- end -}}
{{- end }}
