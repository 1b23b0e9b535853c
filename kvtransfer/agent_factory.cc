#include "kvtransfer/agent_factory.h"

#include <cstdlib>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace tandem::kvtransfer {

absl::Status ParseKvTransport(absl::string_view spec, AgentFactoryConfig* config) {
  const std::vector<std::string> parts = absl::StrSplit(spec, ':');
  if (parts.size() == 1 && parts[0] == "ucx") {
    config->transport = KvTransport::kUcx;
    return absl::OkStatus();
  }
  if (parts.empty() || parts[0] != "libfabric" || parts.size() > 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_transport must be ucx, libfabric, libfabric:<provider> or "
                     "libfabric:<provider>:<rails>, got \"",
                     spec, "\""));
  }
  config->transport = KvTransport::kLibfabric;
  if (parts.size() >= 2) {
    if (parts[1].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv_transport=", spec, ": empty provider"));
    }
    config->libfabric.provider = parts[1];
  }
  if (parts.size() == 3) {
    int rails = 0;
    if (parts[2] == "auto") {
      rails = 0;  // every NIC tied for the nearest
    } else if (!absl::SimpleAtoi(parts[2], &rails) || rails < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv_transport=", spec, ": rails must be a number >= 1 or auto"));
    }
    config->libfabric.rails = rails;
  }
  return absl::OkStatus();
}

absl::Status CheckUcxRdma(absl::string_view tls,
                          const std::vector<std::string>& resources) {
  // "^rc,ud" lists what not to use: it asks for nothing.
  if (absl::StartsWith(absl::StripLeadingAsciiWhitespace(tls), "^")) {
    return absl::OkStatus();
  }
  std::vector<std::string> asked;
  for (absl::string_view t : absl::StrSplit(tls, ',', absl::SkipEmpty())) {
    t = absl::StripAsciiWhitespace(t);
    if (IsUcxRdmaTransport(t)) asked.emplace_back(t);
  }
  if (asked.empty()) return absl::OkStatus();
  for (const std::string& r : resources) {
    if (IsUcxRdmaTransport(absl::string_view(r).substr(0, r.find('/')))) {
      return absl::OkStatus();
    }
  }
  // UCX itself only warns ("transport 'rc' is not available") and carries on
  // with what else the list allows: TCP, the fallback issue 19 refuses.
  return absl::FailedPreconditionError(absl::StrCat(
      "UCX_TLS=", tls, " asks for RDMA (", absl::StrJoin(asked, ","),
      ") but UCX opened only ",
      resources.empty() ? std::string("nothing") : absl::StrJoin(resources, ", "),
      ": no RDMA device UCX can use here (EFA: --kv_transport=libfabric:efa); "
      "--ucx_tls=tcp runs over TCP on purpose"));
}

absl::StatusOr<CreatedAgent> CreateTransferAgent(const AgentFactoryConfig& config) {
  CreatedAgent out;
  if (config.transport == KvTransport::kUcx) {
    auto agent = UcxAgent::Create(config.ucx);
    if (!agent.ok()) return agent.status();
    // The transports UCX may use: the configured UCX_TLS, else the
    // environment's (ucp_config_read honours it), else UCX's own choice.
    const char* env_tls = std::getenv("UCX_TLS");
    const std::string tls = !config.ucx.tls.empty()                    ? config.ucx.tls
                            : (env_tls != nullptr && *env_tls != '\0') ? env_tls
                                                                       : "";
    const std::vector<std::string>& resources = (*agent)->resources();
    if (absl::Status st = CheckUcxRdma(tls, resources); !st.ok()) return st;
    out.description = "ucx";
    out.info.agent = "ucx";
    out.info.provider = tls.empty() ? "auto" : tls;
    out.info.domain = absl::StrJoin(resources, ",");
    out.agent = *std::move(agent);
    return out;
  }
  auto agent = LibfabricAgent::Create(config.libfabric);
  if (!agent.ok()) return agent.status();
  out.description = absl::StrCat("libfabric/", (*agent)->provider());
  out.info.agent = "libfabric";
  out.info.provider = (*agent)->provider();
  out.info.fabric = (*agent)->fabric_name();
  out.info.domain = (*agent)->domain_name();
  out.info.rails = (*agent)->rails();
  if ((*agent)->rails() > 1) {
    absl::StrAppend(&out.description, " x", (*agent)->rails(), " rails");
  }
  out.info.nics = (*agent)->nics();
  out.agent = *std::move(agent);
  return out;
}

}  // namespace tandem::kvtransfer
