# The weights: an S3 bucket (optional: bring your own) linked to an FSx for Lustre
# file system in the GPU zone. The checkpoint is lazy-loaded from S3 on first read;
# `lfs hsm_restore` or a first worker start warms it (deploy/README.md).
resource "aws_s3_bucket" "weights" {
  count  = var.create_weights_bucket ? 1 : 0
  bucket = var.weights_bucket
}

resource "aws_s3_bucket_public_access_block" "weights" {
  count                   = var.create_weights_bucket ? 1 : 0
  bucket                  = aws_s3_bucket.weights[0].id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_security_group" "fsx" {
  name        = "${var.name}-fsx"
  description = "FSx for Lustre from the VPC"
  vpc_id      = aws_vpc.main.id
  ingress {
    description = "Lustre"
    from_port   = 988
    to_port     = 988
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr]
  }
  ingress {
    description = "Lustre"
    from_port   = 1018
    to_port     = 1023
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr]
  }
  ingress {
    description = "Lustre between its servers"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    self        = true
  }
  egress {
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

resource "aws_fsx_lustre_file_system" "weights" {
  storage_capacity            = var.fsx_storage_capacity_gib
  deployment_type             = "PERSISTENT_2"
  per_unit_storage_throughput = var.fsx_throughput_per_tib
  file_system_type_version    = "2.15"
  subnet_ids                  = [aws_subnet.private[0].id]
  security_group_ids          = [aws_security_group.fsx.id]
  data_compression_type       = "NONE"
  tags                        = { Name = "${var.name}-weights" }
}

resource "aws_fsx_data_repository_association" "weights" {
  file_system_id                   = aws_fsx_lustre_file_system.weights.id
  file_system_path                 = "/"
  data_repository_path             = "s3://${var.weights_bucket}/${var.weights_prefix}"
  batch_import_meta_data_on_create = true
  s3 {
    auto_import_policy {
      events = ["NEW", "CHANGED", "DELETED"]
    }
  }
  depends_on = [aws_s3_bucket.weights]
}
