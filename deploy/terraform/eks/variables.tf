variable "region" {
  description = "AWS region of the cluster (and of the Capacity Block)."
  type        = string
  default     = "us-east-1"
}

variable "name" {
  description = "Name of the EKS cluster and prefix of every resource."
  type        = string
  default     = "tandem"
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version."
  type        = string
  default     = "1.32"
}

variable "gpu_availability_zone" {
  description = "Availability zone of the Capacity Block: the GPU nodes, their subnet and FSx live there."
  type        = string
  default     = "us-east-1a"
}

variable "other_availability_zone" {
  description = "A second zone for the EKS control plane's subnets and the system nodes (EKS needs two)."
  type        = string
  default     = "us-east-1b"
}

variable "vpc_cidr" {
  description = "CIDR block of the VPC."
  type        = string
  default     = "10.42.0.0/16"
}

variable "capacity_reservation_id" {
  description = "The p6-b300 Capacity Block's reservation id (cr-...), bought beforehand (deploy/README.md)."
  type        = string
  validation {
    condition     = can(regex("^cr-[0-9a-f]+$", var.capacity_reservation_id))
    error_message = "capacity_reservation_id is a Capacity Block reservation id, cr-...."
  }
}

variable "gpu_instance_type" {
  description = "GPU instance type of the Capacity Block."
  type        = string
  default     = "p6-b300.48xlarge"
}

variable "gpu_node_count" {
  description = "GPU nodes (one Tandem worker pod each: e.g. 1 prefill + 1 decode = 2). At most the Capacity Block's instance count."
  type        = number
  default     = 2
}

variable "efa_interfaces" {
  description = "EFA network interfaces per GPU node (one per network card of the instance type: check `aws ec2 describe-instance-types`)."
  type        = number
  default     = 16
}

variable "system_instance_type" {
  description = "Instance type of the system node group (router, gateway, Prometheus, controllers)."
  type        = string
  default     = "m7i.4xlarge"
}

variable "system_node_count" {
  description = "System nodes."
  type        = number
  default     = 2
}

variable "weights_bucket" {
  description = "Name of the S3 bucket holding the checkpoint (kimi-k3/ under weights_prefix). Created when create_weights_bucket is true."
  type        = string
}

variable "create_weights_bucket" {
  description = "Create the weights bucket (false: it exists already)."
  type        = bool
  default     = false
}

variable "weights_prefix" {
  description = "Prefix in the bucket linked to the FSx file system's /."
  type        = string
  default     = "models/"
}

variable "fsx_storage_capacity_gib" {
  description = "FSx for Lustre capacity (GiB; PERSISTENT_2 takes multiples of 2400). K3's ~1.5 TB fits 2400."
  type        = number
  default     = 4800
}

variable "fsx_throughput_per_tib" {
  description = "FSx for Lustre PERSISTENT_2 throughput per TiB (125, 250, 500 or 1000 MB/s/TiB)."
  type        = number
  default     = 1000
}
