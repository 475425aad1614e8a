module rayfinetune/k8s/tools/ray-operator

go 1.26.0

require github.com/ray-project/kuberay/ray-operator v1.7.0
