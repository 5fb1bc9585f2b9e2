"""Settings: validation names the field, environment loading, no password anywhere."""

from __future__ import annotations

import logging

import pytest

from reliable_mq import (
    BrokerUnavailable,
    ConnectionSettings,
    InvalidSettings,
    PublisherSettings,
    ReliablePublisher,
    redact_url,
)
from reliable_mq.settings import redact_credentials


class TestValidation:
    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"max_in_flight": 0}, "max_in_flight"),
            ({"confirm_timeout": -1}, "confirm_timeout"),
            ({"max_attempts": 0}, "max_attempts"),
            ({"backoff_initial": 5, "backoff_max": 1}, "backoff_max"),
            ({"unknown_option": 1}, "unknown_option"),
        ],
    )
    def test_publisher_settings_name_the_bad_field(
        self, kwargs: dict[str, object], field: str
    ) -> None:
        with pytest.raises(InvalidSettings) as caught:
            PublisherSettings(**kwargs)  # type: ignore[arg-type]
        assert field in str(caught.value)
        assert isinstance(caught.value, ValueError)

    @pytest.mark.parametrize(
        "url",
        ["http://user:s3cret@host/", "amqp://user:s3cret@/", "", "amqp://u:s3cret@h:notaport/"],
    )
    def test_bad_urls_are_rejected_without_echoing_them(self, url: str) -> None:
        with pytest.raises(InvalidSettings) as caught:
            ConnectionSettings(url=url)  # type: ignore[arg-type]
        assert "url" in str(caught.value)
        assert "s3cret" not in str(caught.value)
        assert caught.value.__cause__ is None

    def test_url_parts_override_the_url(self) -> None:
        settings = ConnectionSettings(
            host="rabbit.internal",
            port=5671,
            username="app",
            password="pw-secret",  # type: ignore[arg-type]
            virtual_host="orders",
        )
        (address,) = settings.addresses
        assert str(address.url) == "amqp://app:pw-secret@rabbit.internal:5671/orders"
        assert "pw-secret" not in repr(settings)

    def test_heartbeat_range(self) -> None:
        with pytest.raises(InvalidSettings, match="heartbeat"):
            ConnectionSettings(heartbeat=-1)

    def test_backoff_grows_and_caps(self) -> None:
        settings = PublisherSettings(backoff_initial=0.1, backoff_multiplier=2, backoff_max=0.5)
        assert [settings.backoff(n) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.4, 0.5]


class TestEnvironment:
    def test_values_come_from_reliable_mq_variables(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("RELIABLE_MQ_URL", "amqp://a:pw@h1:5672/,amqp://a:pw@h2:5673/")
        monkeypatch.setenv("RELIABLE_MQ_HEARTBEAT", "7")
        monkeypatch.setenv("RELIABLE_MQ_PUBLISHER_MAX_IN_FLIGHT", "42")
        connection = ConnectionSettings()
        assert connection.heartbeat == 7
        assert [a.url.host for a in connection.addresses] == ["h1", "h2"]
        assert PublisherSettings().max_in_flight == 42

    def test_invalid_environment_value_names_the_field(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("RELIABLE_MQ_PUBLISHER_MAX_IN_FLIGHT", "lots")
        with pytest.raises(InvalidSettings, match="max_in_flight"):
            PublisherSettings()


class TestSecrets:
    def test_repr_and_addresses_hide_the_password(self) -> None:
        settings = ConnectionSettings(url="amqp://user:s3cret@host:5672/vh")  # type: ignore[arg-type]
        assert "s3cret" not in repr(settings)
        assert "s3cret" not in str(settings.addresses)
        assert settings.addresses[0].redacted == "amqp://user:***@host:5672/vh"
        assert redact_url("amqp://host/") == "amqp://host/"

    def test_credentials_in_free_text_are_hidden(self) -> None:
        text = "to amqp://u:p4ss@h:5672/ failed, then amqps://a:b@c/ and redis://:r3d@r:6379/0"
        assert redact_credentials(text) == (
            "to amqp://u:***@h:5672/ failed, then amqps://a:***@c/ and redis://:***@r:6379/0"
        )
        assert redact_credentials("amqp://host:5672/ refused") == "amqp://host:5672/ refused"

    async def test_unreachable_broker_error_and_logs_hide_the_password(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """BrokerUnavailable names the redacted address; nothing logs the secret."""
        caplog.set_level(logging.DEBUG)
        settings = ConnectionSettings(
            url="amqp://user:s3cret@127.0.0.1:1/,amqp://user:s3cret@127.0.0.1:2/",  # type: ignore[arg-type]
            connect_timeout=2,
        )
        publisher = ReliablePublisher(settings)
        with pytest.raises(BrokerUnavailable) as caught:
            await publisher.start()
        assert "127.0.0.1:1" in str(caught.value) and "127.0.0.1:2" in str(caught.value)
        assert "s3cret" not in str(caught.value)
        assert "s3cret" not in caplog.text


class TestConnectionArgument:
    def test_every_form_a_connection_argument_takes(self) -> None:
        """A URL, settings or None become settings; anything else is refused by name."""
        from reliable_mq import ConnectionSettings, InvalidSettings

        settings = ConnectionSettings(url="amqp://u:p@h:5672/")
        assert ConnectionSettings.of(settings) is settings
        assert ConnectionSettings.of("amqp://u:p@h:5672/").addresses[0].url.host == "h"
        assert isinstance(ConnectionSettings.of(None), ConnectionSettings)
        for bad in (5, b"amqp://h/", ["amqp://h/"]):
            with pytest.raises(InvalidSettings, match="expected an AMQP URL"):
                ConnectionSettings.of(bad)  # type: ignore[arg-type]
