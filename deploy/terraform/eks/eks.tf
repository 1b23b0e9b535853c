# The EKS cluster (API and EKS access entries for authentication), its add-ons:
# VPC CNI, CoreDNS, kube-proxy, the Pod Identity agent and the FSx for Lustre CSI
# driver. The NVIDIA and EFA device plugins and the AWS Load Balancer Controller are
# Kubernetes objects installed after `terraform apply` (deploy/README.md, EKS step 4).
resource "aws_iam_role" "cluster" {
  name = "${var.name}-cluster"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "eks.amazonaws.com" }
      Action    = ["sts:AssumeRole", "sts:TagSession"]
    }]
  })
}

resource "aws_iam_role_policy_attachment" "cluster" {
  role       = aws_iam_role.cluster.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonEKSClusterPolicy"
}

resource "aws_eks_cluster" "main" {
  name     = var.name
  version  = var.kubernetes_version
  role_arn = aws_iam_role.cluster.arn

  access_config {
    authentication_mode                         = "API"
    bootstrap_cluster_creator_admin_permissions = true
  }

  vpc_config {
    subnet_ids              = aws_subnet.private[*].id
    endpoint_private_access = true
    endpoint_public_access  = true
  }

  depends_on = [aws_iam_role_policy_attachment.cluster]
}

resource "aws_eks_addon" "vpc_cni" {
  cluster_name = aws_eks_cluster.main.name
  addon_name   = "vpc-cni"
}

resource "aws_eks_addon" "kube_proxy" {
  cluster_name = aws_eks_cluster.main.name
  addon_name   = "kube-proxy"
}

resource "aws_eks_addon" "coredns" {
  cluster_name = aws_eks_cluster.main.name
  addon_name   = "coredns"
  depends_on   = [aws_eks_node_group.system]
}

resource "aws_eks_addon" "pod_identity" {
  cluster_name = aws_eks_cluster.main.name
  addon_name   = "eks-pod-identity-agent"
}

# The FSx for Lustre CSI driver (static volumes: deploy/k8s/components/fsx-weights).
resource "aws_iam_role" "fsx_csi" {
  name               = "${var.name}-fsx-csi"
  assume_role_policy = data.aws_iam_policy_document.pod_identity_trust.json
}

resource "aws_iam_role_policy_attachment" "fsx_csi" {
  role       = aws_iam_role.fsx_csi.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonFSxReadOnlyAccess"
}

resource "aws_eks_addon" "fsx_csi" {
  cluster_name = aws_eks_cluster.main.name
  addon_name   = "aws-fsx-csi-driver"
  pod_identity_association {
    role_arn        = aws_iam_role.fsx_csi.arn
    service_account = "fsx-csi-controller-sa"
  }
  depends_on = [aws_eks_node_group.system, aws_eks_addon.pod_identity]
}

data "aws_iam_policy_document" "pod_identity_trust" {
  statement {
    effect  = "Allow"
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "Service"
      identifiers = ["pods.eks.amazonaws.com"]
    }
  }
}
