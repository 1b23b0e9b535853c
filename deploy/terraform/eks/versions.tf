# Tandem on EKS with p6-b300 nodes: plain hashicorp/aws resources only (no registry
# modules, no other providers), so `terraform validate` runs offline against a local
# provider mirror (tests/deploy:terraform_test). deploy/README.md walks through it.
terraform {
  required_version = ">= 1.5.0"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.80.0, < 6.0.0"
    }
  }
}

provider "aws" {
  region = var.region
  default_tags {
    tags = {
      Project = "tandem"
      Cluster = var.name
    }
  }
}

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
