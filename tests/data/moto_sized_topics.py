"""moto's server, with SNS's topic-sized message limits.

moto 5.2 refuses every SNS message over 262,144 characters and does not know
the `MaximumMessageSize` topic attribute (1,024 to 1,048,576 bytes, 262,144 by
default). Here a topic keeps the attribute it is created or set with,
`GetTopicAttributes` returns it, and a publish is refused with
`InvalidParameter` ("Message too long") when the message body and its
attributes (names, types and values, in bytes) are larger, as SNS counts.
Arguments are moto.server's (`-H 127.0.0.1 -p PORT`).
"""

import sys

import moto.sns.models as models
import moto.sns.responses as responses
from moto.server import main

DEFAULT = 262_144
models.MAXIMUM_MESSAGE_LENGTH = 1 << 40  # checked below, per topic

_publish = models.SNSBackend.publish


def _limit(topic) -> int:
    return int(getattr(topic, "maximum_message_size", DEFAULT) or DEFAULT)


def publish(self, message, arn=None, *args, **kwargs):
    topic = None
    try:
        topic = self.get_topic(arn) if arn else None
    except Exception:  # not a topic (an endpoint): moto's own rules
        pass
    if topic is not None:
        size = len(message.encode("utf-8"))
        for name, value in (kwargs.get("message_attributes") or {}).items():
            size += len(name.encode("utf-8")) + len(value["Type"])
            size += len(str(value["Value"]).encode("utf-8"))
        if size > _limit(topic):
            raise models.InvalidParameterValue(
                "Invalid parameter: Message too long"
            )
    return _publish(self, message, arn, *args, **kwargs)


models.SNSBackend.publish = publish

_get_topic_attributes = responses.SNSResponse.get_topic_attributes


def get_topic_attributes(self):
    answer = _get_topic_attributes(self)
    topic = self.backend.get_topic(self._get_param("TopicArn"))
    answer.result["Attributes"]["MaximumMessageSize"] = str(_limit(topic))
    return answer


responses.SNSResponse.get_topic_attributes = get_topic_attributes

if __name__ == "__main__":
    main(sys.argv[1:])
