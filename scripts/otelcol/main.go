// Command otelcol is a minimal OpenTelemetry Collector for otel_verl tests and
// local use. It is what `builder` (go.opentelemetry.io/collector/cmd/builder)
// would generate, written by hand so that go.mod/go.sum here pin every
// dependency. Build it with scripts/build-otel-binaries.sh.
//
// Components:
//
//	receivers:  otlp (core), otlp_json_file (contrib; replays file-exporter output)
//	processors: batch, resource (contrib; the per-run file configs use it to give spans
//	            without verl.run_id a default file group), tail_sampling (contrib; the
//	            gateway of the multi-node tail-sampling topology)
//	exporters:  debug, otlp_grpc (alias otlp), otlp_http (alias otlphttp), file (contrib),
//	            prometheus (contrib; serves the metrics pipeline for a Prometheus scrape),
//	            loadbalancing (contrib; the per-node agent routes spans by trace id),
//	            clickhouse (contrib; writes the span store's otel_traces table on a
//	            ClickHouse server)
//
// Config providers: env, file, yaml (so ${env:VAR:-default} works).
//
// Versions: core v0.161.0 (stable modules v1.67.0), contrib clickhouseexporter,
// fileexporter, prometheusexporter, loadbalancingexporter, resourceprocessor and
// tailsamplingprocessor v0.161.0, contrib otlpjsonfilereceiver v0.158.0: the Go module
// proxy reachable here refuses v0.160.0 and later of that module (and pkg/stanza
// v0.161.0) with "403 Forbidden ... This module version is not available", so go.mod
// pins v0.158.0, which builds against core v0.161.0. Likewise the proxy refuses
// github.com/aws/aws-sdk-go-v2/service/servicediscovery v1.48.0 (imported by
// loadbalancingexporter v0.161.0 for its AWS Cloud Map resolver, which we do not use), so
// go.mod replaces it with v1.40.2, an API-compatible release the proxy serves.
package main

import (
	"os"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/confmap/provider/yamlprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/exporter/debugexporter"
	"go.opentelemetry.io/collector/exporter/otlpexporter"
	"go.opentelemetry.io/collector/exporter/otlphttpexporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/processor"
	"go.opentelemetry.io/collector/processor/batchprocessor"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/clickhouseexporter"
	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter"
	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/loadbalancingexporter"
	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/prometheusexporter"
	"github.com/open-telemetry/opentelemetry-collector-contrib/processor/resourceprocessor"
	"github.com/open-telemetry/opentelemetry-collector-contrib/processor/tailsamplingprocessor"
	"github.com/open-telemetry/opentelemetry-collector-contrib/receiver/otlpjsonfilereceiver"
)

// aliasProvider is implemented by factories that also register a deprecated
// type name (e.g. otlp_grpc also answers to "otlp").
type aliasProvider interface{ DeprecatedAlias() component.Type }

// modules maps each component type (and its deprecated alias) to the Go module
// it comes from; `otelcol components` prints it.
func modules[T component.Factory](fs map[component.Type]T, mod map[component.Type]string) map[component.Type]string {
	for t, f := range fs {
		if ap, ok := any(f).(aliasProvider); ok && ap.DeprecatedAlias().String() != "" {
			mod[ap.DeprecatedAlias()] = mod[t]
		}
	}
	return mod
}

const (
	core    = "go.opentelemetry.io/collector/"
	contrib = "github.com/open-telemetry/opentelemetry-collector-contrib/"
	coreV   = " v0.161.0" // keep in sync with go.mod
	stableV = " v1.67.0"
	jsonV   = " v0.158.0" // otlpjsonfilereceiver
)

func components() (otelcol.Factories, error) {
	var err error
	f := otelcol.Factories{Telemetry: otelconftelemetry.NewFactory()}

	if f.Receivers, err = otelcol.MakeFactoryMap[receiver.Factory](
		otlpreceiver.NewFactory(),
		otlpjsonfilereceiver.NewFactory(),
	); err != nil {
		return otelcol.Factories{}, err
	}
	f.ReceiverModules = modules(f.Receivers, map[component.Type]string{
		otlpreceiver.NewFactory().Type():         core + "receiver/otlpreceiver" + coreV,
		otlpjsonfilereceiver.NewFactory().Type(): contrib + "receiver/otlpjsonfilereceiver" + jsonV,
	})

	if f.Processors, err = otelcol.MakeFactoryMap[processor.Factory](
		batchprocessor.NewFactory(),
		resourceprocessor.NewFactory(),
		tailsamplingprocessor.NewFactory(),
	); err != nil {
		return otelcol.Factories{}, err
	}
	f.ProcessorModules = modules(f.Processors, map[component.Type]string{
		batchprocessor.NewFactory().Type():        core + "processor/batchprocessor" + coreV,
		resourceprocessor.NewFactory().Type():     contrib + "processor/resourceprocessor" + coreV,
		tailsamplingprocessor.NewFactory().Type(): contrib + "processor/tailsamplingprocessor" + coreV,
	})

	if f.Exporters, err = otelcol.MakeFactoryMap[exporter.Factory](
		debugexporter.NewFactory(),
		otlpexporter.NewFactory(),
		otlphttpexporter.NewFactory(),
		fileexporter.NewFactory(),
		prometheusexporter.NewFactory(),
		loadbalancingexporter.NewFactory(),
		clickhouseexporter.NewFactory(),
	); err != nil {
		return otelcol.Factories{}, err
	}
	f.ExporterModules = modules(f.Exporters, map[component.Type]string{
		debugexporter.NewFactory().Type():         core + "exporter/debugexporter" + coreV,
		otlpexporter.NewFactory().Type():          core + "exporter/otlpexporter" + coreV,
		otlphttpexporter.NewFactory().Type():      core + "exporter/otlphttpexporter" + coreV,
		fileexporter.NewFactory().Type():          contrib + "exporter/fileexporter" + coreV,
		prometheusexporter.NewFactory().Type():    contrib + "exporter/prometheusexporter" + coreV,
		loadbalancingexporter.NewFactory().Type(): contrib + "exporter/loadbalancingexporter" + coreV,
		clickhouseexporter.NewFactory().Type():    contrib + "exporter/clickhouseexporter" + coreV,
	})
	return f, nil
}

func main() {
	set := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{
			Command:     "otelcol",
			Description: "otel_verl minimal OpenTelemetry Collector",
			Version:     "0.161.0-otel_verl",
		},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{
					envprovider.NewFactory(),
					fileprovider.NewFactory(),
					yamlprovider.NewFactory(),
				},
			},
		},
		ProviderModules: map[string]string{
			"env":  core + "confmap/provider/envprovider" + stableV,
			"file": core + "confmap/provider/fileprovider" + stableV,
			"yaml": core + "confmap/provider/yamlprovider" + stableV,
		},
	}
	if err := otelcol.NewCommand(set).Execute(); err != nil {
		os.Exit(1) // cobra already printed the error
	}
}
