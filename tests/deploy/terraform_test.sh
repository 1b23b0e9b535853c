#!/bin/bash
# deploy/terraform/eks: `terraform fmt -check` and `terraform validate`, offline,
# against the local hashicorp/aws provider mirror (TANDEM_TF_PLUGIN_DIR, default
# /opt/tf-plugins); then shows both catch a broken copy. Skips with a message where
# terraform or the mirror is absent.
set -euo pipefail
plugins="${TANDEM_TF_PLUGIN_DIR:-/opt/tf-plugins}"
if ! command -v terraform >/dev/null 2>&1; then
  echo "SKIP: terraform is not installed (not a Debian package; the development image has 1.11)"
  exit 0
fi
if [[ ! -d "$plugins/registry.terraform.io/hashicorp/aws" ]]; then
  echo "SKIP: no hashicorp/aws provider mirror under $plugins (terraform init cannot fetch it offline)"
  exit 0
fi
src="deploy/terraform/eks"
work="${TEST_TMPDIR:-$(mktemp -d)}/tf"
rm -rf "$work"
mkdir -p "$work/eks"
cp -L "$src"/*.tf "$src"/terraform.tfvars.example "$work/eks/"
(( $(find "$work/eks" -name '*.tf' | wc -l) >= 7 )) || { echo "FAIL: Terraform files missing" >&2; exit 1; }
export TF_IN_AUTOMATION=1 TF_INPUT=0 CHECKPOINT_DISABLE=1
export TF_CLI_CONFIG_FILE="$work/terraformrc" TF_DATA_DIR="$work/data"
: >"$TF_CLI_CONFIG_FILE"
cd "$work/eks"

terraform fmt -check -diff -no-color .
echo "terraform fmt: clean"
if ! out="$(terraform init -backend=false -plugin-dir="$plugins" -no-color 2>&1)"; then
  echo "$out" >&2
  echo "FAIL: terraform init against $plugins" >&2
  exit 1
fi
terraform validate -no-color

# Both checks can fail: a misformatted file, a reference to nothing.
printf 'output "x" {\nvalue=aws_vpc.main.id\n}\n' >broken_fmt.tf
if terraform fmt -check . >/dev/null 2>&1; then
  echo "FAIL: terraform fmt -check accepted a misformatted file" >&2
  exit 1
fi
printf 'output "y" {\n  value = aws_vpc.nothing.id\n}\n' >broken_ref.tf
if terraform validate -no-color >/dev/null 2>&1; then
  echo "FAIL: terraform validate accepted a reference to an undeclared resource" >&2
  exit 1
fi
echo "terraform validate: valid (and refuses a broken copy)"
