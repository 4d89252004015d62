// The one browser bundle: dist/esa-device-sdk.browser.js (ESM, minified, every dependency in).
import { build } from "esbuild";

await build({
  entryPoints: ["src/index.ts"],
  bundle: true,
  format: "esm",
  platform: "browser",
  target: ["es2022"],
  minify: true,
  keepNames: true, // an EsaError's name is its class name (docs/sdk-js.md), minified or not
  sourcemap: true,
  legalComments: "eof",
  outfile: "dist/esa-device-sdk.browser.js",
  logLevel: "warning",
});
