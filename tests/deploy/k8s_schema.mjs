// Typed schema check of rendered Kubernetes objects with the npm package
// kubernetes-models (tools/node, pinned): reads a JSON array of objects from the
// file named by argv[2], validates each against its kind's OpenAPI schema (types,
// required fields, enums, formats; unknown fields are accepted, as the package
// does), and prints one line per object. Exits 1 when any object fails or has a
// kind the package does not know and that is not in argv[3] (comma-separated
// apiVersion/kind list checked elsewhere, e.g. the HyperPod CRD).
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";
import path from "node:path";

const modules = process.env.TANDEM_NODE_MODULES;
const objects = JSON.parse(readFileSync(process.argv[2], "utf8"));
const elsewhere = new Set((process.argv[3] || "").split(",").filter(Boolean));
let failures = 0;
let checked = 0;
for (const obj of objects) {
  const id = `${obj.apiVersion}/${obj.kind} ${obj.metadata?.name}`;
  if (elsewhere.has(`${obj.apiVersion}/${obj.kind}`)) {
    console.log(`skip ${id} (checked against its CRD)`);
    continue;
  }
  const [group, version] = obj.apiVersion.includes("/")
    ? obj.apiVersion.split("/")
    : ["", obj.apiVersion];
  const dir = group ? `${group}/${version}` : version;
  const file = path.join(modules, "kubernetes-models", dir, `${obj.kind}.js`);
  let Kind;
  try {
    Kind = (await import(pathToFileURL(file).href))[obj.kind];
  } catch (e) {
    console.log(`FAIL ${id}: kubernetes-models has no ${dir}/${obj.kind} (${e.message})`);
    failures++;
    continue;
  }
  try {
    new Kind(obj).validate();
    checked++;
    console.log(`ok   ${id}`);
  } catch (e) {
    failures++;
    console.log(`FAIL ${id}: ${e.message}`);
  }
}
console.log(`${checked} objects valid, ${failures} failed`);
process.exit(failures ? 1 : 0);
