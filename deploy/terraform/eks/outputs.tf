output "cluster_name" {
  value = aws_eks_cluster.main.name
}

output "cluster_endpoint" {
  description = "The EKS API endpoint."
  value       = aws_eks_cluster.main.endpoint
}

output "kubeconfig_command" {
  value = "aws eks update-kubeconfig --region ${var.region} --name ${aws_eks_cluster.main.name}"
}

output "vpc_id" {
  description = "For the AWS Load Balancer Controller's --aws-vpc-id."
  value       = aws_vpc.main.id
}

# deploy/k8s/components/fsx-weights/fsx-volume.yaml takes these three.
output "fsx_file_system_id" {
  value = aws_fsx_lustre_file_system.weights.id
}

output "fsx_dns_name" {
  value = aws_fsx_lustre_file_system.weights.dns_name
}

output "fsx_mount_name" {
  value = aws_fsx_lustre_file_system.weights.mount_name
}

output "gpu_node_group" {
  value = aws_eks_node_group.gpu.node_group_name
}
