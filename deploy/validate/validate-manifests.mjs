// validate-manifests.mjs: offline schema check of rendered Kubernetes
// manifests. Every document is checked against the OpenAPI schema of its
// apiVersion/kind as vendored by the kubernetes-models packages (core API and
// prometheus-operator CRDs), so a wrong type (a string replica count, a numeric
// probe port name, a missing required field) fails. A kind with no vendored
// schema fails too, rather than passing unchecked. Unknown extra fields are
// not rejected: the Kubernetes schemas allow them.
//
//   node validate-manifests.mjs rendered.yaml   (or - for stdin)
import { readFileSync } from "node:fs";
import yaml from "js-yaml";

// API groups whose models live in a package other than kubernetes-models.
const crdPackages = {
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
};

async function modelFor(apiVersion, kind) {
  const group = apiVersion.includes("/") ? apiVersion.split("/")[0] : "";
  const pkg = crdPackages[group] ?? "kubernetes-models";
  const module = `${pkg}/${apiVersion}/${kind}`;
  try {
    return (await import(module))[kind];
  } catch (err) {
    if (err.code === "ERR_MODULE_NOT_FOUND" || err.code === "ERR_PACKAGE_PATH_NOT_EXPORTED") {
      return undefined;
    }
    throw err;
  }
}

const input = process.argv[2];
if (!input) {
  console.error("usage: node validate-manifests.mjs FILE|-");
  process.exit(2);
}
const documents = yaml
  .loadAll(readFileSync(input === "-" ? 0 : input, "utf8"))
  .filter((doc) => doc !== null);

let failures = 0;
for (const doc of documents) {
  const name = `${doc.apiVersion}/${doc.kind} ${doc.metadata?.name ?? "(no name)"}`;
  if (typeof doc.apiVersion !== "string" || typeof doc.kind !== "string") {
    console.error(`FAIL ${name}: apiVersion and kind must be strings`);
    failures++;
    continue;
  }
  const Model = await modelFor(doc.apiVersion, doc.kind);
  if (!Model) {
    console.error(`FAIL ${name}: no schema for ${doc.apiVersion} ${doc.kind}`);
    failures++;
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`ok   ${name}`);
  } catch (err) {
    console.error(`FAIL ${name}: ${err.message}`);
    failures++;
  }
}
console.log(`${documents.length - failures} passed, ${failures} failed`);
process.exit(failures === 0 && documents.length > 0 ? 0 : 1);
