# Nodes: a system node group (router, gateway, Prometheus, controllers) and the
# p6-b300 node group on the Capacity Block: EKS's AL2023 NVIDIA AMI, one EFA
# interface per network card, a cluster placement group, the instance-store NVMe
# disks as one RAID0 (/mnt/k8s-disks/0, where the workers' init container copies
# the weights), tainted so that only the GPU pods land there.
resource "aws_iam_role" "node" {
  name = "${var.name}-node"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset([
    "AmazonEKSWorkerNodePolicy",
    "AmazonEKS_CNI_Policy",
    "AmazonEC2ContainerRegistryReadOnly",
    "AmazonSSMManagedInstanceCore",
  ])
  role       = aws_iam_role.node.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/${each.value}"
}

resource "aws_eks_node_group" "system" {
  cluster_name    = aws_eks_cluster.main.name
  node_group_name = "system"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = aws_subnet.private[*].id
  ami_type        = "AL2023_x86_64_STANDARD"
  instance_types  = [var.system_instance_type]
  disk_size       = 100
  scaling_config {
    desired_size = var.system_node_count
    min_size     = 1
    max_size     = var.system_node_count + 2
  }
  labels     = { "tandem.dev/pool" = "system" }
  depends_on = [aws_iam_role_policy_attachment.node]
}

# EFA requires a security group that lets all traffic in from and out to itself.
resource "aws_security_group" "efa" {
  name        = "${var.name}-efa"
  description = "EFA: all traffic between the GPU nodes"
  vpc_id      = aws_vpc.main.id
  ingress {
    from_port = 0
    to_port   = 0
    protocol  = "-1"
    self      = true
  }
  egress {
    from_port = 0
    to_port   = 0
    protocol  = "-1"
    self      = true
  }
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_placement_group" "gpu" {
  name     = "${var.name}-gpu"
  strategy = "cluster"
}

resource "aws_launch_template" "gpu" {
  name = "${var.name}-gpu"

  # The Capacity Block: instances start only inside its window, in its zone.
  instance_market_options {
    market_type = "capacity-block"
  }
  capacity_reservation_specification {
    capacity_reservation_target {
      capacity_reservation_id = var.capacity_reservation_id
    }
  }

  placement {
    group_name = aws_placement_group.gpu.name
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_size           = 200
      volume_type           = "gp3"
      delete_on_termination = true
    }
  }

  # Network card 0: EFA with an IP (the node's primary interface); every other
  # card: EFA-only (RDMA, no IP).
  dynamic "network_interfaces" {
    for_each = range(var.efa_interfaces)
    content {
      device_index          = network_interfaces.value == 0 ? 0 : 1
      network_card_index    = network_interfaces.value
      interface_type        = network_interfaces.value == 0 ? "efa" : "efa-only"
      delete_on_termination = true
      security_groups = [
        aws_eks_cluster.main.vpc_config[0].cluster_security_group_id,
        aws_security_group.efa.id,
      ]
    }
  }

  # nodeadm (AL2023): the instance-store NVMe disks as one RAID0 array.
  user_data = base64encode(<<-EOT
    MIME-Version: 1.0
    Content-Type: multipart/mixed; boundary="BOUNDARY"

    --BOUNDARY
    Content-Type: application/node.eks.aws

    apiVersion: node.eks.aws/v1alpha1
    kind: NodeConfig
    spec:
      instance:
        localStorage:
          strategy: RAID0

    --BOUNDARY--
  EOT
  )

  metadata_options {
    http_tokens                 = "required"
    http_put_response_hop_limit = 2
  }
}

resource "aws_eks_node_group" "gpu" {
  cluster_name    = aws_eks_cluster.main.name
  node_group_name = "p6-b300"
  node_role_arn   = aws_iam_role.node.arn
  # Only the Capacity Block's zone.
  subnet_ids     = [aws_subnet.private[0].id]
  ami_type       = "AL2023_x86_64_NVIDIA"
  capacity_type  = "CAPACITY_BLOCK"
  instance_types = [var.gpu_instance_type]

  launch_template {
    id      = aws_launch_template.gpu.id
    version = aws_launch_template.gpu.latest_version
  }

  scaling_config {
    desired_size = var.gpu_node_count
    min_size     = 0
    max_size     = var.gpu_node_count
  }

  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  labels = { "tandem.dev/pool" = "gpu" }

  update_config {
    max_unavailable = 1
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}
